"""The ready-made receivers (airflow_resumable.receivers) against real servers: HTTP and e-mail."""
