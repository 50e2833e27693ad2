"""Provider metadata, read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any

from airflow_resumable import __version__


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-resumable",
        "name": "Resumable batches",
        "description": "Resumable batch tasks: a durable step journal so that retries and Clear resume "
        "instead of re-sending, and sends with an unknown outcome are held for a human.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Resumable batches",
                "external-doc-url": "https://pypi.org/project/airflow-provider-resumable/",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "Resumable batches",
                "python-modules": [
                    "airflow_resumable.operators.resumable_batch",
                    "airflow_resumable.operators.resolve",
                    "airflow_resumable.operators.review",
                ],
            }
        ],
        "hooks": [
            {"integration-name": "Resumable batches", "python-modules": ["airflow_resumable.hooks.journal"]}
        ],
        "sensors": [
            {"integration-name": "Resumable batches", "python-modules": ["airflow_resumable.sensors.held_items"]}
        ],
        # The "Resumable jobs" page; Airflow 3.3 loads it through the airflow.plugins entry point and
        # reads this list only with [core] lazy_discover_providers = False (it skips the duplicate).
        "triggers": [
            {"integration-name": "Resumable batches", "python-modules": ["airflow_resumable.triggers.held_items"]}
        ],
        "plugins": [
            {"name": "resumable_jobs", "plugin-class": "airflow_resumable.plugins.ResumableJobsPlugin"}
        ],
        "extra-links": ["airflow_resumable.links.ResumableJobLink"],
        "config": {
            "resumable": {
                "description": "Step journal of airflow-provider-resumable: a worker-local SQLite file, "
                "or a shared PostgreSQL journal that every worker reaches (journal_conn_id).",
                "options": {
                    "journal_conn_id": {
                        "description": "An Airflow Postgres connection holding a shared journal, so a "
                        "retry or Clear resumes on any worker (Celery, Kubernetes, managed Airflow). When "
                        "set it wins over journal_path. Never taken from dag_run.conf or XCom.",
                        "version_added": "0.2.0",
                        "type": "string",
                        "example": "resumable_journal",
                        "default": "",
                    },
                    "journal_schema": {
                        "description": "Schema of the shared journal's tables (created if missing). A "
                        "connection's extra 'journal_schema' wins.",
                        "version_added": "0.2.0",
                        "type": "string",
                        "example": "resumable",
                        "default": "resumable",
                    },
                    "claim_timeout": {
                        "description": "Seconds within which the shared journal frees the job of a runner "
                        "whose host vanished or was cut off from the database (TCP keepalives and "
                        "tcp_user_timeout on both ends). A connection's extra 'claim_timeout' wins.",
                        "version_added": "0.2.0",
                        "type": "float",
                        "example": "60",
                        "default": "30",
                    },
                    "journal_path": {
                        "description": "Journal file on the worker's local disk. Default: "
                        "$AIRFLOW_HOME/resumable/journal.sqlite3. Never on NFS/SMB/sshfs or a "
                        "cloud-sync folder; never taken from dag_run.conf.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "/var/lib/airflow/resumable/journal.sqlite3",
                        "default": "",
                    },
                    "allow_network_filesystem": {
                        "description": "Open a SQLite journal on a network or cloud-sync filesystem anyway "
                        "(refused by default: SQLite's WAL mode does not work there). Read by every task, "
                        "the CLI and the Resumable jobs page; a batch task's allow_network_filesystem= wins. "
                        "Only for a mount known to give real POSIX locks and shared memory to one host.",
                        "version_added": "0.3.0",
                        "type": "boolean",
                        "example": "True",
                        "default": "False",
                    },
                    "settle_in_task": {
                        "description": "Settle a receiver's refusals (HTTP 429) and failed sends in the task: "
                        "sent again after the wait it asks for, or looked up after a backoff, at the "
                        "receiver's pace (SPEC section 12). False: the first failing send fails the task, as "
                        "in 0.2. A batch task's settle_in_task= wins. The waits count against "
                        "execution_timeout.",
                        "version_added": "0.3.0",
                        "type": "boolean",
                        "example": "False",
                        "default": "True",
                    },
                    "on_journal_behind": {
                        "description": "What a batch task does when its journal has fewer IN_FLIGHT marks for "
                        "its job than the high-water mark kept in the task state store (the journal was "
                        "restored, copied or failed over: SPEC section 13). refuse: fail, sending nothing. "
                        "verify: every send the journal has no record of asks the step's verify first (a "
                        "step without verify is held); a try that goes through the whole batch re-bases the "
                        "mark. A batch task's on_journal_behind= wins. Airflow >= 3.3 only (no task state "
                        "store before).",
                        "version_added": "0.3.0",
                        "type": "string",
                        "example": "verify",
                        "default": "refuse",
                    },
                    "max_attempts": {
                        "description": "Sends and look-ups one step of one item gets in a try when settling in "
                        "the task; also the failure rounds in a row after which a try stops (the receiver "
                        "is down). A batch task's max_attempts= wins.",
                        "version_added": "0.3.0",
                        "type": "integer",
                        "example": "10",
                        "default": "6",
                    },
                    "durability": {
                        "description": "full: fsync the IN_FLIGHT mark before every send (power-loss "
                        "safe). normal: WAL + synchronous=NORMAL (survives a killed process, not a "
                        "power cut).",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "normal",
                        "default": "full",
                    },
                },
            }
        },
    }
