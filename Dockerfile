# Airflow 3.x image with this provider installed from the repository (not _PIP_ADDITIONAL_REQUIREMENTS).
ARG AIRFLOW_VERSION=3.3.2
FROM apache/airflow:${AIRFLOW_VERSION}-python3.11
COPY --chown=airflow:root pyproject.toml README.md /opt/provider/
COPY --chown=airflow:root airflow_resumable /opt/provider/airflow_resumable
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" "/opt/provider[http,postgres]"
