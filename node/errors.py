"""The one exception base of the node package; every error raised here derives from it."""


class NodeError(Exception):
    """Base class of errors raised by prime_node.node."""


class ConfigError(NodeError):
    """A configuration value is missing, unknown or out of range; the message names the field and its source."""


class TaskError(NodeError):
    """A task set or task file is malformed; the message names the file, row and column."""


class EngineError(NodeError):
    """The inference engine cannot load a model or run a request."""


class ModelError(NodeError):
    """The embedded model cannot be created, trained or loaded."""
