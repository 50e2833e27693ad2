"""Whole deployments and deliverables: CeleryExecutor, docker-compose, the distribution, the demo, the benchmarks."""
