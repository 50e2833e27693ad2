"""The operators, sensor, review task, metrics and link inside real Airflow."""
