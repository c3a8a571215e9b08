"""The transformers backend: batched Gumbel-max generation with a KV cache, and padding-aware prefill.

The model is driven through its base model (`model.base_model`, whose `last_hidden_state` is the output
of the final norm) and its output embeddings (the LM head), instead of through `model(...)`. The hidden
states the proofs commit to are then a by-product of the forward pass: no extra layers are kept (as
`output_hidden_states=True` would) and no hook is needed. `_check_head_split` proves at load time that
head(base(x)) reproduces the model's own logits, so architectures that post-process logits (soft-capping,
scaling) are refused instead of silently sampled wrongly.

Batching: prompts are left-padded, with an attention mask and explicit position ids, so that every
sample's positions are those it would have alone. Samples that finish leave the batch (their rows of the
KV cache are dropped), and requests are sorted by prompt length before being cut into micro-batches of at
most `max_batch_size`, to keep padding small. A prefill (the validator's pass) right-pads without a mask,
in groups of similar length chosen by `prefill_batches.length_buckets`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from ...proofs.gumbel import MAX_SEED, gumbel_noise, perturbed_scores
from ..errors import EngineError
from .prefill_batches import CALL_COST_TOKENS, length_buckets
from .types import Completion, FinishReason, PrefillResult, SampleRequest, SamplingParams

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' is float32 on CPU (exact, and bf16 matmuls are slow there) and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise EngineError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineError(
            "CUDA was requested (--gpu) but torch sees no CUDA device; run without --gpu, "
            "or install a CUDA build of torch and check the driver (nvidia-smi)"
        )
    if device == "cuda":
        exact_float32_matmuls()


def exact_float32_matmuls() -> None:
    """Turn TF32 off for float32 matmuls and convolutions on CUDA (process-wide).

    The float32 proof bounds (docs/proofs.md) were calibrated on IEEE float32 arithmetic; TF32 keeps 10
    mantissa bits, so a float32 node or validator with it on would stray by bfloat16-like amounts. torch's
    default is already off for matmuls, but any library imported earlier (or an operator's
    set_float32_matmul_precision) could have turned it on. bfloat16 compute is unaffected.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# One load at a time per process: from_pretrained builds the model on the meta device under a context that is
# not thread-safe, and a second load on another thread (two validators in one process, as the tests run them)
# can end it under the first, which then fails with "Cannot copy out of meta tensor".
_LOAD_LOCK = threading.Lock()


def load_hf_model(model_dir: Path, device: str, dtype: torch.dtype) -> PreTrainedModel:
    """AutoModelForCausalLM from a local directory only (never the hub), in eval mode on `device`."""
    model_dir = Path(model_dir).expanduser()
    if not (model_dir / "config.json").is_file():
        raise EngineError(
            f"model directory {model_dir} has no config.json: not an HF model directory (e.g. one made by "
            "`prime-node model init --out DIR`)"
        )
    try:
        # safetensors only: a pytorch_model.bin would be unpickled, and checkpoints may come from peers.
        with _LOAD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, local_files_only=True, dtype=dtype, use_safetensors=True, trust_remote_code=False
            )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        raise EngineError(f"cannot load the model in {model_dir}: {exc}") from exc
    # transformers declares `to` through a decorator whose stub takes the model as its first argument.
    return model.to(device).eval()  # type: ignore[arg-type]


class HFEngine:
    """InferenceEngine on transformers, for CPU and CUDA."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_id: int | None = None,
        max_batch_size: int = 16,
        threads: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise EngineError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise EngineError(
                f"{type(model).__name__} has no output embeddings (LM head); it cannot generate"
            )
        config = model.config
        self.eos_token_id, self.pad_token_id = eos_and_pad(config, eos_token_id)
        self.vocab_size = int(self.head.weight.shape[0])
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.device = str(next(model.parameters()).device.type)
        self.dtype = next(model.parameters()).dtype
        self.max_batch_size = max_batch_size
        self.threads = threads
        self._check_head_split()

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        max_batch_size: int = 16,
        threads: int | None = None,
    ) -> HFEngine:
        check_device(device)
        _apply_threads(threads)
        model = load_hf_model(model_dir, device, resolve_dtype(dtype, device))
        engine = cls(model, max_batch_size=max_batch_size, threads=threads)
        logger.info(
            "loaded %s from %s on %s (%s, max batch %d)",
            type(model).__name__,
            model_dir,
            device,
            engine.dtype,
            max_batch_size,
        )
        return engine

    @torch.inference_mode()
    def _check_head_split(self) -> None:
        ids = torch.arange(min(8, self.vocab_size), device=self.device).unsqueeze(0)
        reference = self.model(input_ids=ids).logits.float()
        ours = self.head(self.base(input_ids=ids).last_hidden_state).float()
        if not torch.allclose(reference, ours, rtol=1e-3, atol=1e-3):
            raise EngineError(
                f"{type(self.model).__name__} computes its logits other than lm_head(last_hidden_state) "
                "(e.g. soft-capping or scaling); this engine does not support that architecture"
            )

    # ----------------------------------------------------------------- generation

    def generate(
        self, requests: Sequence[SampleRequest], params: SamplingParams, *, capture_hidden: bool = True
    ) -> list[Completion]:
        self.validate_requests(requests, params)
        _apply_threads(self.threads)
        results: list[Completion | None] = [None] * len(requests)
        for chunk in self._micro_batches([len(r.prompt_ids) for r in requests]):
            done = self._generate_batch([requests[i] for i in chunk], params, capture_hidden)
            for i, completion in zip(chunk, done):
                results[i] = completion
        return [c for c in results if c is not None]

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache | None
    ) -> torch.Tensor:
        out = self.base(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state

    @torch.inference_mode()
    def _generate_batch(
        self, requests: list[SampleRequest], params: SamplingParams, capture: bool
    ) -> list[Completion]:
        dev, batch, temperature = self.device, len(requests), params.temperature
        lengths = torch.tensor([len(r.prompt_ids) for r in requests], device=dev)
        ids, mask = self._left_pad([r.prompt_ids for r in requests])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        prompt_hidden = self._forward(ids, mask, positions, cache)
        logits = self.head(prompt_hidden[:, -1]).float()
        # Rows fed after each step, indexed [sample, step]; a sample's row s is the state at len(prompt) + s.
        fed = (
            torch.empty(
                batch, params.max_new_tokens - 1, prompt_hidden.shape[-1], dtype=self.dtype, device=dev
            )
            if capture and params.max_new_tokens > 1
            else None
        )
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=dev)
        active = torch.arange(batch, device=dev)  # indices (into `requests`) of samples still generating
        next_position = lengths.clone()
        outputs: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        reasons: list[FinishReason] = ["length"] * batch
        for step in range(params.max_new_tokens):
            noise = gumbel_noise(seeds[active], torch.full_like(active, step), logits.shape[-1])
            tokens = perturbed_scores(logits, temperature, noise).argmax(dim=-1)
            chosen = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
            finished = tokens == self.eos_token_id
            for sample, token, logprob in zip(active.tolist(), tokens.tolist(), chosen.tolist()):
                outputs[sample].append(token)
                logprobs[sample].append(logprob)
                if token == self.eos_token_id:
                    reasons[sample] = "eos"
            if step == params.max_new_tokens - 1:
                break  # the last token is never fed: nothing would read its state
            if bool(finished.any()):
                keep = (~finished).nonzero()[:, 0]
                if keep.numel() == 0:
                    break
                cache.batch_select_indices(keep)
                active, tokens, mask, next_position = (
                    active[keep],
                    tokens[keep],
                    mask[keep],
                    next_position[keep],
                )
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            hidden = self._forward(tokens[:, None], mask, next_position[:, None], cache)[:, -1]
            if fed is not None:
                fed[active, step] = hidden
            logits = self.head(hidden).float()
            next_position += 1
        return [
            self._completion(r, outputs[b], logprobs[b], reasons[b], prompt_hidden[b], fed, b, capture)
            for b, r in enumerate(requests)
        ]

    def _completion(
        self,
        request: SampleRequest,
        output: list[int],
        logprobs: list[float],
        reason: FinishReason,
        prompt_hidden: torch.Tensor,
        fed: torch.Tensor | None,
        index: int,
        capture: bool,
    ) -> Completion:
        hidden = None
        if capture:
            rows = [prompt_hidden[prompt_hidden.shape[0] - len(request.prompt_ids) :]]
            if fed is not None:
                rows.append(fed[index, : len(output) - 1])
            hidden = torch.cat(rows).to("cpu")
        return Completion(
            prompt_ids=tuple(request.prompt_ids),
            output_ids=tuple(output),
            finish_reason=reason,
            seed=request.seed,
            output_logprobs=tuple(logprobs),
            hidden_states=hidden,
        )

    # ----------------------------------------------------------------- prefill

    def prefill(
        self, sequences: Sequence[Sequence[int]], keep_from: Sequence[int] | None = None
    ) -> list[PrefillResult]:
        for i, sequence in enumerate(sequences):
            self._validate_ids(sequence, f"sequence {i}")
        starts = _kept_starts(sequences, keep_from)
        _apply_threads(self.threads)
        results: list[PrefillResult | None] = [None] * len(sequences)
        lengths = [len(s) for s in sequences]
        # Groups of similar length (not fixed-size groups): padding is compute the verifier wastes.
        for chunk in length_buckets(lengths, self.max_batch_size, CALL_COST_TOKENS.get(self.device, 64)):
            batch = self._prefill_batch([sequences[i] for i in chunk], [starts[i] for i in chunk])
            for i, result in zip(chunk, batch, strict=True):
                results[i] = result
        return [r for r in results if r is not None]

    @torch.inference_mode()
    def _prefill_batch(self, sequences: list[Sequence[int]], starts: list[int]) -> list[PrefillResult]:
        # Right padding and no attention mask: causal attention already keeps every real position away
        # from the pads after it, and without a padding mask the attention kernel takes its causal fast
        # path (no (B, L, L) mask is built). Positions are 0.. for every sequence, as when prefilled alone.
        lengths = [len(s) for s in sequences]
        ids = torch.full((len(sequences), max(lengths)), self.pad_token_id, dtype=torch.long)
        for b, sequence in enumerate(sequences):
            ids[b, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
        ids = ids.to(self.device)
        positions = torch.arange(ids.shape[1], device=self.device).expand(len(sequences), -1)
        hidden = self.base(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        # The LM head once over the kept rows of every sequence: none over the pads, nor over the positions
        # before keep_from (a verifier's prompts).
        kept = [n - k for n, k in zip(lengths, starts, strict=True)]
        real = torch.cat([hidden[b, k:n] for b, (n, k) in enumerate(zip(lengths, starts, strict=True))])
        states, logits = real.to("cpu"), self.head(real).float().to("cpu")
        return [
            PrefillResult(hidden_states=h, logits=g, first_position=k)
            for h, g, k in zip(states.split(kept), logits.split(kept), starts, strict=True)
        ]

    # ----------------------------------------------------------------- helpers

    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
        return [order[i : i + self.max_batch_size] for i in range(0, len(order), self.max_batch_size)]

    def _left_pad(self, prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            ids[b, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[b, longest - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _validate_ids(self, ids: Sequence[int], what: str) -> None:
        if len(ids) == 0:
            raise EngineError(f"{what} is empty; at least one token is needed")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise EngineError(f"{what} has a token id outside [0, {self.vocab_size})")
        if self.max_positions is not None and len(ids) > self.max_positions:
            raise EngineError(f"{what} has {len(ids)} tokens; the model takes at most {self.max_positions}")

    def validate_requests(self, requests: Sequence[SampleRequest], params: SamplingParams) -> None:
        if not (params.temperature > 0 and math.isfinite(params.temperature)):
            raise EngineError(f"temperature must be a finite number > 0, got {params.temperature}")
        if params.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        for i, request in enumerate(requests):
            self._validate_ids(request.prompt_ids, f"prompt of request {i}")
            if not 0 <= request.seed <= MAX_SEED:
                raise EngineError(f"seed of request {i} is {request.seed}; seeds lie in [0, 2^63)")
            total = len(request.prompt_ids) + params.max_new_tokens
            if self.max_positions is not None and total > self.max_positions:
                raise EngineError(
                    f"request {i}: prompt ({len(request.prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) "
                    f"exceeds the model's {self.max_positions} positions"
                )


def eos_and_pad(config: PretrainedConfig, eos_token_id: int | None = None) -> tuple[int, int]:
    """The EOS id generation stops on and the id padding uses, from the model's config (`eos_token_id`
    overrides the config's EOS): what HFEngine and a pipeline stage (which loads no whole model) both use."""
    eos = _single_eos(eos_token_id if eos_token_id is not None else config.eos_token_id)
    # The pad id only fills masked slots; any valid id works when the config names none.
    return eos, config.pad_token_id if config.pad_token_id is not None else eos


def _single_eos(eos: int | list[int] | None) -> int:
    if eos is None:
        raise EngineError("the model config names no eos_token_id; set one in config.json")
    if isinstance(eos, (list, tuple)):
        if not eos:
            raise EngineError("the model config has an empty eos_token_id list")
        if len(eos) > 1:
            logger.warning("model lists several EOS ids %s; the engine stops on the first, %d", eos, eos[0])
        return int(eos[0])
    return int(eos)


def _apply_threads(threads: int | None) -> None:
    # torch's thread pool is process-wide; setting it per call keeps two engines from fighting over it.
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _kept_starts(sequences: Sequence[Sequence[int]], keep_from: Sequence[int] | None) -> list[int]:
    if keep_from is None:
        return [0] * len(sequences)
    if len(keep_from) != len(sequences):
        raise EngineError(f"keep_from has {len(keep_from)} entries for {len(sequences)} sequences")
    for i, (sequence, start) in enumerate(zip(sequences, keep_from, strict=True)):
        if not 0 <= start < len(sequence):
            raise EngineError(f"keep_from {start} of sequence {i} is outside its {len(sequence)} positions")
    return list(keep_from)
