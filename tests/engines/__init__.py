"""The journal on each engine: files and servers, locks, migrations, fleet scale, what a hostile environment does to it."""
