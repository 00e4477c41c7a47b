"""Logging under the `ember` logger, switched on per topic by EMBER_LOGS (like TORCH_LOGS).

EMBER_LOGS=graph,guards,recompiles,graph_breaks,output_code,fallbacks,dynamic,check,saved,distributed  (or "all")
"""
from __future__ import annotations

import logging
import os

TOPICS = ("graph", "guards", "recompiles", "graph_breaks", "output_code", "fallbacks", "autograd", "bytecode", "autotune",
          "dynamic", "check", "saved", "distributed")
_root = logging.getLogger("ember")


def _enabled_topics() -> set[str]:
    raw = os.environ.get("EMBER_LOGS", "")
    names = {t.strip().lstrip("+") for t in raw.split(",") if t.strip()}
    return set(TOPICS) if "all" in names else names


def _setup() -> None:
    topics = _enabled_topics()
    for t in topics & set(TOPICS):  # the others inherit the `ember` logger's level (so caplog can raise it)
        logging.getLogger(f"ember.{t}").setLevel(logging.DEBUG)
    if topics and not _root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[ember.%(topic)s] %(message)s"))
        h.addFilter(_TopicFilter())
        _root.addHandler(h)
        _root.propagate = False


class _TopicFilter(logging.Filter):
    def filter(self, record):
        record.topic = record.name.split(".", 1)[-1]
        return True


def get_logger(topic: str) -> logging.Logger:
    assert topic in TOPICS, topic
    return logging.getLogger(f"ember.{topic}")


def enabled(topic: str) -> bool:
    return get_logger(topic).isEnabledFor(logging.DEBUG)


_setup()
