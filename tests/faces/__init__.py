"""What people use: the airflow-resumable CLI and the Resumable jobs page (API server, browser)."""
