"""The runner and its decisions, whatever the engine: the article's scenario, crashes at every
boundary, bad input, stop, key generations, people's decisions."""
