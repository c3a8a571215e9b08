"""The one exception base of the node package; every error raised here derives from it."""


class NodeError(Exception):
    """Base class of errors raised by prime_node.node."""


class OperatorActionNeeded(Exception):
    """Base mixed into errors a task raises for a condition the operator must fix, not a bug (settings that
    disagree with the run's): the process stops, the supervisor's `wait()` raises the error itself so the
    command prints its message, and the log gets that message without a traceback."""


class ConfigError(NodeError):
    """A configuration value is missing, unknown or out of range; the message names the field and its source."""


class TaskError(NodeError):
    """A task set or task file is malformed; the message names the file, row and column."""


class EngineError(NodeError):
    """The inference engine cannot load a model or run a request."""


class ModelError(NodeError):
    """The embedded model cannot be created, trained or loaded."""


class PromptError(NodeError, OperatorActionNeeded):
    """The run's prompts cannot be built with this checkpoint: its chat template does not compile, raises,
    loops or renders differently each time, or the run's settings need a template the checkpoint lacks."""
