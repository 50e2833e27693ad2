"""The test harness: what the tests run against rather than tests themselves - real Airflow (a
harness, its fork server, its servers, a CeleryExecutor deployment), throwaway PostgreSQL and mail
servers, the core tests' receivers, scenarios and child processes, both journal engines' raw views,
the previous release, the CPU report. demo/ and benchmarks/ use it too (``from tests.support...``)."""
