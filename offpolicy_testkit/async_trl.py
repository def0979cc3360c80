"""CPU stand-ins for TRL 1.16's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``): the packed tree attention in
SDPA, a rollout worker that samples with a perturbed copy of the policy, and the weight transfer into that copy.

What they replace and why:

* ``sdpa_tree_attention`` — TRL registers its packed (prefix-trie) attention as ``"tree_fa3"`` in transformers'
  ``AttentionInterface``, backed by the FlashAttention-3 kernel (CUDA only). This is the same attention in
  ``torch.nn.functional.scaled_dot_product_attention``: each segment's queries attend, causally aligned at the
  bottom right, to the K/V rows of its root-to-segment path (``tree_kv_index`` / ``tree_cu_seqlens_k``), exactly what
  ``flash_attn_varlen_func(..., causal=True)`` computes. :func:`cpu_tree_attention` registers it for a block and
  restores TRL's entry after.
* :class:`PerturbedRolloutWorker` — TRL's ``AsyncRolloutWorker`` talks to a vLLM server. This worker keeps its own
  copy of the policy (the "engine"), samples completions from it with a known perturbation (``noise_std``: fixed
  seeded Gaussian noise added to the engine's logits, and μ is the log-prob under those perturbed logits, i.e. the
  distribution that really sampled) and tags each sample with the policy version it was told last.
  :class:`VLLMRolloutWorker` samples from a live vLLM server instead (μ = vLLM's log-probs), its weights pushed by
  offpolicy's :class:`~offpolicy.integrations.trl.async_sync.FileWeightTransfer` (tests/vllm/).
* :class:`CopyWeightTransfer` — TRL's ``WeightTransferClient`` streams weights to vLLM over NCCL. This one copies the
  streamed ``(name, tensor)`` pairs into the worker's engine, so the engine samples with the weights of its version.

* :class:`TamperedTransfer` — any of these transfers with one push broken (a tensor dropped, or written wrong): what
  the async trainer's sync check must catch. Both workers also ``score`` given tokens (the engine the check scores).
* :func:`with_minimal_chat_template` — a copy of an embedded tokenizer that TRL's own ``AsyncRolloutWorker`` can
  render prompts and parse completions with (the shipped tokenizers have no chat template).

The worker fills ``samples_per_version`` samples on ``start()`` and on every version bump, as TRL's own test stub does;
with more samples per version than one optimizer step consumes, the queue holds older versions' samples and the
trainer sees staleness 0, 1, 2, ….
"""

from __future__ import annotations

import contextlib
import copy
import queue
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch


def sdpa_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                        tree_cu_seqlens_k, tree_max_seqlen_q=None, tree_max_seqlen_k=None, scaling=None,
                        sliding_window=None, softcap=None, **kwargs):
    """TRL's ``tree_attention`` (``trl/experimental/async_grpo/packing.py``) in SDPA: query/key/value ``[1, H, N, D]``
    (K/V may have fewer heads: grouped-query attention), output ``[1, N, H, D]``."""
    if sliding_window or softcap:
        raise ValueError("sdpa_tree_attention: sliding_window / softcap are not implemented in the CPU stand-in")
    q = query[0].transpose(0, 1)  # [N, H, D]
    k = key[0].transpose(0, 1).index_select(0, tree_kv_index)  # [K, Hkv, D]: the paths laid end to end
    v = value[0].transpose(0, 1).index_select(0, tree_kv_index)
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)  # [H, Lq, D]
        ks = k[cu_k[s]:cu_k[s + 1]].transpose(0, 1).repeat_interleave(groups, dim=0)  # [H, Lk, D]
        vs = v[cu_k[s]:cu_k[s + 1]].transpose(0, 1).repeat_interleave(groups, dim=0)
        lq, lk = qs.shape[1], ks.shape[1]
        # bottom-right causal: query i of the segment is path position lk - lq + i, and sees positions <= that
        allowed = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + lk - lq)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scaling)
        out[cu_q[s]:cu_q[s + 1]] = o.transpose(0, 1)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def cpu_tree_attention() -> Iterator[None]:
    """Within the block, TRL's ``"tree_fa3"`` attention is :func:`sdpa_tree_attention`; TRL's entry is restored after
    (AsyncGRPOTrainer's constructor registers its own, so enter this after constructing the trainer)."""
    from transformers import AttentionInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    mapping = AttentionInterface._global_mapping
    missing = object()
    before = mapping.get(TREE_ATTENTION, missing)
    AttentionInterface.register(TREE_ATTENTION, sdpa_tree_attention)
    try:
        yield
    finally:
        if before is missing:
            del mapping[TREE_ATTENTION]
        else:
            mapping[TREE_ATTENTION] = before


@contextlib.contextmanager
def cpu_constructor() -> Iterator[None]:
    """Within the block, TRL 1.16's ``AsyncGRPOTrainer`` can be constructed on a CPU-only torch: its constructor asks
    ``torch.cuda.get_device_name`` for the MFU's peak FLOPs (an AssertionError without CUDA); here the peak is unknown
    (None: TRL then logs no MFU, as it does for an unknown GPU). Restored after."""
    from trl.experimental.async_grpo import async_grpo_trainer

    before = async_grpo_trainer.get_peak_flops_per_device
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    try:
        yield
    finally:
        async_grpo_trainer.get_peak_flops_per_device = before


class _QueueWorker:
    """A ``RolloutWorkerProtocol`` (TRL 1.16) filled in the trainer's thread: ``rollout_buffer`` of ``RolloutSample``,
    an empty ``metrics_queue``; ``samples_per_version`` samples on ``start()`` and on every version bump, in groups of
    ``num_generations`` completions of one prompt with group-normalised advantages of ``reward_fn(text, answer)``.
    Subclasses sample one completion: ``_sample_one(prompt_ids) -> (ids, log μ)``.

    The trainer's dataloader (accelerate's dispatcher) draws the next micro-batch before the current step's weight
    sync, so at least two micro-batches must be queued before each sync: ``samples_per_version`` ≥ one step's samples
    (the fill on ``start()`` and the cold sync's make the second)."""

    def __init__(self, tokenizer: Any, prompts: Sequence[tuple[str, str]], reward_fn: Any, *,
                 num_generations: int = 4, max_new_tokens: int = 6, samples_per_version: int = 8) -> None:
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.reward_fn = reward_fn
        self.num_generations = num_generations
        self.max_new_tokens = max_new_tokens
        self.samples_per_version = samples_per_version
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0
        self.versions_served: list[int] = []
        self._group = 0
        self._pending: list[Any] = []

    # -- the protocol -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._fill()

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version
        self._fill()

    def check_health(self, stale_after_s: float) -> None:
        raise RuntimeError(f"{type(self).__name__}: the trainer drained the queue; raise samples_per_version")

    # -- sampling -----------------------------------------------------------------------------------------------
    def _fill(self) -> None:
        for _ in range(self.samples_per_version):
            if not self._pending:
                self._pending = self._sample_group()
            self.rollout_buffer.put(self._pending.pop(0))
            self.versions_served.append(self.model_version)

    def _sample_one(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        raise NotImplementedError

    @torch.no_grad()
    def _sample_group(self) -> list[Any]:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        prompt, answer = self.prompts[self._group % len(self.prompts)]
        group_id, self._group = self._group, self._group + 1
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        drawn = [self._sample_one(prompt_ids) for _ in range(self.num_generations)]
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in drawn]
        rewards = np.array([float(self.reward_fn(t, answer)) for t in texts])
        std = rewards.std()
        advantages = (rewards - rewards.mean()) / (std if std > 0 else 1.0)
        out = []
        for (ids, logps), text, reward, advantage in zip(drawn, texts, rewards, advantages):
            out.append(RolloutSample(
                prompt=[{"role": "user", "content": prompt}], completion=[{"role": "assistant", "content": text}],
                input_ids=np.array(prompt_ids + ids), completion_mask=np.array([0] * len(prompt_ids) + [1] * len(ids)),
                old_log_probs=np.array([0.0] * len(prompt_ids) + logps, dtype=np.float32),
                advantage=float(advantage), model_version=self.model_version, group_id=group_id,
                metrics={"reward": float(reward)}))
        return out


class PerturbedRolloutWorker(_QueueWorker):
    """Completions sampled by ``engine`` (a copy of the policy, its weights set by :class:`CopyWeightTransfer`) with
    ``noise_std`` Gaussian noise on its logits; μ is the log-prob under those perturbed logits."""

    def __init__(self, engine: torch.nn.Module, tokenizer: Any, prompts: Sequence[tuple[str, str]], reward_fn: Any, *,
                 noise_std: float = 0.0, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(tokenizer, prompts, reward_fn, **kwargs)
        self.engine = copy.deepcopy(engine).eval()
        self.engine.config._attn_implementation = "sdpa"  # the engine runs plain attention (its own forward)
        self.noise_std = noise_std
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's teacher-forced log-probs ``[B, T]`` and mask (its weights, without the sampling noise): what
        the sync check compares with the trainer after each transfer."""
        from offpolicy.rollout.scoring import sequence_logprobs

        return sequence_logprobs(self.engine, prompt_ids, completion_ids)

    def engine_parameters(self) -> tuple[Any, dict[str, list[str]]]:
        """The engine's tensors under the checkpoint's names (the sync check's parameter layer), nothing packed."""
        return self.engine.named_parameters(), {}

    def _sample_one(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        ids = torch.tensor([prompt_ids])
        new, logps = [], []
        for _ in range(self.max_new_tokens):
            logits = self.engine(input_ids=ids).logits[0, -1].float()
            logits = logits + self.noise_std * torch.randn(logits.shape, generator=self.generator)
            logp = torch.log_softmax(logits, -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
            new.append(token)
            logps.append(float(logp[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
        return new, logps


class VLLMRolloutWorker(_QueueWorker):
    """Completions from a vLLM server's ``/v1/completions`` (``url``; served model name ``model``; the server started
    with ``--logprobs-mode processed_logprobs``): μ is vLLM's own log-prob of each sampled token. Its weights come
    from the trainer through :class:`offpolicy.integrations.trl.async_sync.FileWeightTransfer`."""

    def __init__(self, url: str, model: str, tokenizer: Any, prompts: Sequence[tuple[str, str]], reward_fn: Any, *,
                 temperature: float = 1.0, seed: int = 0, timeout: float = 120.0, **kwargs: Any) -> None:
        from offpolicy.rollout.protocols import VLLMProtocol
        from offpolicy.rollout.sampling import SamplingConfig

        super().__init__(tokenizer, prompts, reward_fn, **kwargs)
        self.url = url.rstrip("/")
        self.protocol = VLLMProtocol(model, ignore_eos=True)  # every completion max_new_tokens long
        self.cfg = SamplingConfig(temperature=temperature, max_new_tokens=self.max_new_tokens)
        self.seed, self.timeout, self.requests = seed, timeout, 0

    def _sample_one(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        from offpolicy.rollout.http import post_json

        self.requests += 1
        where = f"vllm request {self.requests}"
        body = self.protocol.request(prompt_ids, self.cfg, self.seed + self.requests)
        answer = post_json(self.url + self.protocol.path, body, timeout=self.timeout, what=where)
        done = self.protocol.parse(answer, self.cfg, where=where, vocab_size=None)
        done.check_lengths(where)
        return list(done.ids), list(done.logp)


    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's teacher-forced log-probs ``[B, T]`` and mask (vLLM's prompt log-probs), for the sync check."""
        from offpolicy.rollout.server_engine import ServerRolloutEngine

        return ServerRolloutEngine(self.url, self.protocol, timeout=self.timeout).score(prompt_ids, completion_ids)


class CopyWeightTransfer:
    """A ``WeightTransferProtocol`` (TRL 1.16) on CPU: the streamed ``(name, tensor)`` pairs are copied into the
    worker's engine (TRL strips wrapper prefixes, so the names are the checkpoint's); ``pushes`` counts the syncs."""

    def __init__(self, worker: PerturbedRolloutWorker) -> None:
        self.worker = worker
        self.pushes = 0

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.worker.engine.named_parameters())
        with torch.no_grad():
            for name, tensor in iterator:
                if name not in params:
                    raise KeyError(f"CopyWeightTransfer: the engine has no parameter {name!r}")
                params[name].copy_(tensor)
        self.pushes += 1

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class TamperedTransfer:
    """A ``WeightTransferProtocol`` around ``inner`` (:class:`CopyWeightTransfer`,
    :class:`~offpolicy.integrations.trl.async_sync.FileWeightTransfer`, …) that breaks push number ``at_push``
    (1: the cold one): the tensor named ``drop`` is left out of the stream, the one named ``corrupt`` sent as
    ``corrupt_value`` everywhere (a wrong tensor of the right shape). What the sync check must catch."""

    def __init__(self, inner: Any, *, at_push: int, drop: str | None = None, corrupt: str | None = None,
                 corrupt_value: float = 0.0) -> None:
        if (drop is None) == (corrupt is None):
            raise ValueError("TamperedTransfer: give one of drop= and corrupt=")
        self.inner, self.at_push, self.drop, self.corrupt = inner, at_push, drop, corrupt
        self.corrupt_value = corrupt_value
        self.pushes = 0
        self.tampered: list[str] = []  # the names actually dropped or corrupted

    def __getattr__(self, name: str) -> Any:  # init_weight_transfer, pause, resume, destroy, bind, folder …
        return getattr(self.inner, name)

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.pushes += 1
        self.inner.send_weights(self._stream(iterator) if self.pushes == self.at_push else iterator)

    def _stream(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iterator:
            if name == self.drop:
                self.tampered.append(name)
                continue
            if name == self.corrupt:
                self.tampered.append(name)
                tensor = torch.full_like(tensor, self.corrupt_value)
            yield name, tensor


# the embedded tokenizers have no chat template; TRL's AsyncRolloutWorker renders every prompt through one and parses
# every completion with a response template (it refuses a chat template it does not recognise unless one is set)
MINIMAL_CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
MINIMAL_RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "fields": {"content": {"content": "text"}}}


def with_minimal_chat_template(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` (the shipped model's is untouched) that TRL's default ``AsyncRolloutWorker`` can use:
    a chat template that renders the messages' contents after the BOS token — the ids ``tokenizer(text)`` gives for a
    one-message prompt — and a response template that reads the whole completion as the assistant's content."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = MINIMAL_CHAT_TEMPLATE
    tok.response_template = MINIMAL_RESPONSE_TEMPLATE
    return tok


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward TRL's worker can call in its own (spawned) process: the completion's length mod 3, so a group's
    advantages are not all 0 (a module-level function: a lambda does not pickle)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) % 3) for t in texts]
