"""airflow-provider-resumable: resumable batch tasks for Apache Airflow.

The journal core (:mod:`airflow_resumable.journal`, :mod:`airflow_resumable.runner`) imports nothing
from Airflow; the operators and sensors adapt Airflow's context to it. Every error is in
:mod:`airflow_resumable.exceptions`, under ``ResumableError``.
"""

__all__ = ["__version__"]
__version__ = "0.3.0"
