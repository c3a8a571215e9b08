"""The vLLM backend for `--gpu` (UNTESTED: vLLM cannot be installed or run on this project's machines).

Written against vLLM's documented offline API: `LLM(..., logits_processors=[FQCN])`, `SamplingParams`
with `extra_args`, `TokensPrompt`, `LLM.generate`. vLLM is imported only when this backend is loaded.

Tokens come from vLLM, sampled by `GumbelLogitsProcessor` (node/engine/vllm_gumbel.py) under greedy
decoding, so they follow the engine-wide rule argmax(logits / T + g(seed, t)). vLLM's public API exposes
neither the per-position hidden states of generated tokens nor log-probabilities under softmax(logits / T)
(its logprobs are of the raw or of the processed logits), so both come from one prefill of prompt + output
with the transformers CUDA backend, the same code path a validator runs: the TOPLOC commitments are then
built from exactly the states the verifier will recompute. That costs a second copy of the weights on the
GPU (hence `gpu_memory_utilization` below 1) and one prefill pass, cheap next to decoding.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import EngineError
from .hf import HFEngine
from .types import Completion, FinishReason, PrefillResult, SampleRequest, SamplingParams

logger = logging.getLogger(__name__)

PROCESSOR_FQCN = "prime_node.node.engine.vllm_gumbel:GumbelLogitsProcessor"


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


class VLLMEngine:
    """InferenceEngine whose generation runs on vLLM and whose prefill runs on transformers (CUDA)."""

    def __init__(self, llm: Any, prefill_engine: HFEngine) -> None:
        self.llm = llm
        self.prefill_engine = prefill_engine
        self.eos_token_id = prefill_engine.eos_token_id
        self.vocab_size = prefill_engine.vocab_size
        self.device = "cuda"

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        dtype: str = "auto",
        max_batch_size: int = 64,
        gpu_memory_utilization: float = 0.5,
    ) -> VLLMEngine:
        from vllm import LLM  # lazy: vLLM is optional and slow to import

        prefill_engine = HFEngine.load(model_dir, device="cuda", dtype=dtype, max_batch_size=max_batch_size)
        try:
            llm = LLM(
                model=str(Path(model_dir).expanduser()),
                dtype=str(prefill_engine.dtype).removeprefix("torch."),
                max_num_seqs=max_batch_size,
                gpu_memory_utilization=gpu_memory_utilization,
                logits_processors=[PROCESSOR_FQCN],
                seed=0,
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise EngineError(f"vLLM cannot load {model_dir}: {exc}") from exc
        logger.info("loaded %s with vLLM (generation) and transformers (prefill)", model_dir)
        return cls(llm, prefill_engine)

    def generate(
        self, requests: Sequence[SampleRequest], params: SamplingParams, *, capture_hidden: bool = True
    ) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        from .vllm_gumbel import SEED_ARG, TEMPERATURE_ARG

        self.prefill_engine.validate_requests(requests, params)
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        sampling = [
            VLLMSamplingParams(
                n=1,
                temperature=0.0,  # greedy over logits / T + g, which the processor writes into the logits
                max_tokens=params.max_new_tokens,
                stop_token_ids=[self.eos_token_id],
                ignore_eos=False,
                detokenize=False,
                extra_args={SEED_ARG: r.seed, TEMPERATURE_ARG: float(params.temperature)},
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False)
        generated = [tuple(out.outputs[0].token_ids) for out in outputs]
        reasons = [self._finish_reason(ids, params) for ids in generated]
        prefills = self.prefill_engine.prefill([r.prompt_ids + ids for r, ids in zip(requests, generated)])
        return [
            _completion(r, ids, reason, pre, params.temperature, capture_hidden)
            for r, ids, reason, pre in zip(requests, generated, reasons, prefills)
        ]

    def _finish_reason(self, output_ids: tuple[int, ...], params: SamplingParams) -> FinishReason:
        if output_ids and output_ids[-1] == self.eos_token_id:
            return "eos"
        if len(output_ids) == params.max_new_tokens:
            return "length"
        raise EngineError(
            f"vLLM stopped a sample after {len(output_ids)} of {params.max_new_tokens} tokens without EOS "
            f"{self.eos_token_id}; does the model's generation_config list other stop tokens?"
        )

    def prefill(
        self, sequences: Sequence[Sequence[int]], keep_from: Sequence[int] | None = None
    ) -> list[PrefillResult]:
        return self.prefill_engine.prefill(sequences, keep_from)


def _completion(
    request: SampleRequest,
    output_ids: tuple[int, ...],
    reason: FinishReason,
    prefill: PrefillResult,
    temperature: float,
    capture_hidden: bool,
) -> Completion:
    start = len(request.prompt_ids) - 1  # the row whose logits produced output token 0
    rows = prefill.logits[start : start + len(output_ids)]
    logprobs = torch.log_softmax(rows / temperature, dim=-1).gather(-1, torch.tensor(output_ids)[:, None])[
        :, 0
    ]
    return Completion(
        prompt_ids=tuple(request.prompt_ids),
        output_ids=output_ids,
        finish_reason=reason,
        seed=request.seed,
        output_logprobs=tuple(logprobs.tolist()),
        # Generation never feeds the final output token, so neither does the returned state.
        hidden_states=prefill.hidden_states[:-1] if capture_hidden else None,
    )
