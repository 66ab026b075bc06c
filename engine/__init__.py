"""stepgate's engine: a continuous-batching engine for Qwen2-family models with a paged KV pool."""
from .config import LINEAGE, PREDECESSOR, EngineConfig, lineage_config
from .engine import Engine, StepRecord
from .errors import (BadArrivalTimeError, BadBudgetError, BadPromptError, BadRequestIdError, ConfigError,
                     DuplicateRequestIdError, EmptyPromptError, EngineDeadError, ExceedsMaxPositionsError,
                     NeverFitsError, NoRoomError, PoisonedLogitsError, PoolInvariantError, PoolTooLargeError,
                     RequestError, RequestNotDoneError, TokenOutOfVocabError, UnknownRequestError)
from .request import RequestResult
from .scheduler import CancelResult, StepKind
from .workload import RequestSpec, Workload, get_workload

__all__ = ["Engine", "EngineConfig", "StepRecord", "LINEAGE", "PREDECESSOR", "lineage_config", "RequestResult",
           "CancelResult", "StepKind", "RequestSpec", "Workload", "get_workload", "RequestError", "EmptyPromptError",
           "TokenOutOfVocabError", "ExceedsMaxPositionsError", "BadBudgetError", "NeverFitsError",
           "DuplicateRequestIdError", "PoisonedLogitsError", "BadPromptError", "BadRequestIdError",
           "BadArrivalTimeError", "UnknownRequestError", "RequestNotDoneError", "ConfigError", "PoolInvariantError",
           "PoolTooLargeError", "NoRoomError", "EngineDeadError"]
