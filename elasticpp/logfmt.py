"""How the agent's log lines look: text for people, or one JSON object a line for a log
pipeline (`--log-format json`: Loki, Elasticsearch, Cloud Logging parse it as it is)."""

from __future__ import annotations

import json
import logging
import time

FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object a record: time (UTC, ISO 8601), level, logger, node_id, message, and
    the traceback as `exception` when there is one."""

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "node_id": self.node_id,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: int, log_format: str, node_id: str) -> None:
    """The root logger's one handler (stderr), in `log_format` (one of FORMATS)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(node_id))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s [{node_id}] %(name)s: %(message)s")
        )
    logging.basicConfig(level=level, handlers=[handler], force=True)
