"""Triggers run by the Airflow triggerer (deferrable sensors)."""
