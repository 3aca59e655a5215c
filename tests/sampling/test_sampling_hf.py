"""Greedy generation equals HF transformers `generate` (PyTorch CPU), token for token.

Tiny random Qwen2 / Qwen3 / Llama checkpoints are written by `transformers`
itself (O(1) weights, so next-token choices are far from ties), loaded with
`rlx.policy.load_hf_checkpoint`, and decoded by both; the rlx side runs with a
pool so small that sequences are preempted and recomputed, and (Qwen2) with a
large pool and with a stop token.
"""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

from rlx import policy, sampling  # noqa: E402

VOCAB = 96
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33], [71], [12, 4, 50, 19], [90, 91, 7, 25, 25, 64, 1]]
M = 8

_COMMON = dict(
  vocab_size=VOCAB,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=64,
  rms_norm_eps=1e-6,
)
_HF = {
  "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False),
  "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True),
  "llama": lambda: transformers.LlamaConfig(
    **_COMMON,
    attention_bias=True,
    rope_theta=500000.0,
    rope_scaling={
      "rope_type": "llama3",
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16,
    },
  ),
}
_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}

BASE = sampling.SamplerConfig(
  max_slots=4,
  page_size=4,
  num_pages=5,  # one full sequence (9 + 8 - 1 = 16 tokens): forces preemption
  max_prompt_len=9,
  max_new_tokens=M,
  temperature=0.0,
  steps_per_sync=4,
  prefill_chunk=8,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  out = {}
  for seed, (family, make) in enumerate(_HF.items()):
    hf_config = make()
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[family])(hf_config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
      for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
          p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
          p.copy_(0.2 * noise)
        elif "embed_tokens" in name:  # smaller when tied: else x . E^T repeats the input token
          p.copy_(noise * (0.1 if hf_config.tie_word_embeddings else 1.0))
        else:
          p.copy_(noise / np.sqrt(p.shape[1]))
    directory = tmp_path_factory.mktemp(family)
    model.save_pretrained(directory)
    out[family] = (str(directory), model)
  return out


def _hf_greedy(model, prompt, eos=None):
  with torch.no_grad():
    out = model.generate(
      torch.tensor([prompt]),
      attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
      max_new_tokens=M,
      do_sample=False,
      eos_token_id=eos,
      pad_token_id=0,
    )
  return out[0, len(prompt) :].numpy()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_greedy_equals_transformers_generate_with_preemption(checkpoints, family):
  directory, model = checkpoints[family]
  config, params = policy.load_hf_checkpoint(directory)
  out = sampling.Sampler(config, BASE).generate(
    params, PROMPTS, num_samples=2, rng=jax.random.key(0)
  )
  assert out.stats["preemptions"] > 0
  distinct = set()
  for i, prompt in enumerate(PROMPTS):
    want = _hf_greedy(model, prompt)
    distinct |= {(i, t) for t in want.tolist()}
    for j in range(2):
      np.testing.assert_array_equal(out.tokens[2 * i + j], want, err_msg=f"prompt {i}")
  assert len(distinct) > 2 * len(PROMPTS)  # not a degenerate repetition


def test_greedy_large_pool_and_stop_token_equal_transformers(checkpoints):
  directory, model = checkpoints["qwen2"]
  config, params = policy.load_hf_checkpoint(directory)
  want = [_hf_greedy(model, p) for p in PROMPTS]
  stop = int(want[0][3])
  cfg = dataclasses.replace(BASE, num_pages=40, stop_token_ids=(stop,))
  out = sampling.Sampler(config, cfg).generate(params, PROMPTS, rng=jax.random.key(0))
  assert out.stats["preemptions"] == 0
  for i, prompt in enumerate(PROMPTS):
    hf = _hf_greedy(model, prompt, eos=stop)  # HF pads with 0 after the stop token
    np.testing.assert_array_equal(out.tokens[i, : len(hf)], hf, err_msg=f"prompt {i}")
    assert not out.tokens[i, len(hf) :].any()
    row = want[i].tolist()
    assert out.lengths[i] == (row.index(stop) + 1 if stop in row else M)
  assert out.finish_reason[0] == "stop"
