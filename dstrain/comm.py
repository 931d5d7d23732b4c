"""Moved to `dstrain.dist.comm`; this name stays importable. Like ``deepspeed.comm``, it also has the
communication logger's ``log_summary`` (`dstrain.dist.comms_logger`)."""

from dstrain.dist.comm import Comm, CommStatistics
from dstrain.dist.comms_logger import log_summary

__all__ = ["Comm", "CommStatistics", "log_summary"]
