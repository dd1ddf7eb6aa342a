"""vLLM's logging as xmix-lens's verbosity asks (xmix_lens/verbosity.py): its level, and a filter
that drops the warnings no user of xmix-lens can act on (each listed with why)."""
import logging

import vllm.logger  # noqa: F401 (configures the "vllm" logger and its handler when first imported)

# vLLM warnings that no user of xmix-lens can act on (a message starts with one of these)
NOT_ACTIONABLE = (
    "Passing raw prompts to InputProcessor is deprecated",  # xmix-lens hands vLLM token ids it made itself
    "Using None for EOS token id because tokenizer is not initialized",  # EOS is xmix-lens's (skip_tokenizer_init)
    "Chat template warmup failed",  # vLLM's tokenizer is skipped on purpose: xmix-lens tokenizes
    "The global random seed is set to",  # the in-process engine, as xmix-lens runs it
    "Model Runner V2 requires Triton",  # the CPU: vLLM picks its runner itself
    "Triton is installed",  # the CPU: Triton has no CPU backend (xmix-lens runs its torch twins there)
    "libtcmalloc is not found in LD_PRELOAD",  # advice for a server's launch script, not a notebook
    "libiomp is not found in LD_PRELOAD",
    "CPU backend doesn't allow to use `torch.set_num_threads`",  # said once in the user guide instead
    "WorkspaceManager already initialized",  # a second engine in one process
)


class NotActionable(logging.Filter):
    def __init__(self):
        super().__init__()
        self.active = True

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.active and record.getMessage().startswith(NOT_ACTIONABLE))


def configure(level: str, drop_not_actionable: bool) -> None:
    """vLLM's loggers at `level` (a logging level name); its non-actionable warnings dropped or kept."""
    logger = logging.getLogger("vllm")
    logger.setLevel(level)
    for handler in logger.handlers:
        handler.setLevel(level)
        kept = [f for f in handler.filters if isinstance(f, NotActionable)]
        if not kept:
            kept = [NotActionable()]
            handler.addFilter(kept[0])
        kept[0].active = drop_not_actionable
