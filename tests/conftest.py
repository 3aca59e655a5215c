"""Test session setup and shared fixtures.

Eight fake CPU devices are requested before JAX is imported anywhere, so the
sharding tests can build real meshes on a CPU-only machine. Single-device
tests are unaffected (they use the default device). `$RLX_TEST_XLA_FLAGS`
(default: LLVM at -O0 and XLA:CPU's classic emitters, for faster compiles) is
added too; subprocess tests
that set their own XLA_FLAGS add it to theirs. The tokenizer fixtures
write a tiny HF tokenizer directory (byte-level BPE, chat template) in the
test: no download.

JAX's persistent compilation cache is on for the session, in one temporary
directory shared by the pytest-xdist workers and by every subprocess a test
starts (removed at the end): a program that several tests, workers or
processes build from separate `jax.jit` objects is compiled once and then
loaded. It is handed on through JAX's own environment variables
(`JAX_COMPILATION_CACHE_DIR` and the two thresholds, set to 0 so every program
is kept). `RLX_TEST_JAX_CACHE=0` turns it off.
"""

import json
import os
import shutil
import tempfile

_FLAG = "--xla_force_host_platform_device_count=8"
# Faster compiles for the tests (and the subprocesses that pass it on): LLVM at
# -O0 roughly halves XLA:CPU's compile of a train step, and XLA:CPU's classic
# elemental emitters instead of its MLIR fusion emitters cut what is left by
# about 3x (2.1 s -> 0.7 s for a tiny train step); the tiny test programs run
# about as fast. `RLX_TEST_XLA_FLAGS=""` turns both off.
os.environ.setdefault(
  "RLX_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
for _flag in (_FLAG, *os.environ["RLX_TEST_XLA_FLAGS"].split()):
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The session's compilation cache: created by the first process (the xdist
# controller, or the only process), inherited by the workers it starts.
_CACHE_ENV = "RLX_TEST_JAX_CACHE_DIR"
_CACHE_OWNER = None
if os.environ.get("RLX_TEST_JAX_CACHE", "1") != "0":
  if not os.environ.get(_CACHE_ENV):
    os.environ[_CACHE_ENV] = _CACHE_OWNER = tempfile.mkdtemp(prefix="rlx-test-jax-cache-")
  # Read by JAX at import, here and in every subprocess that inherits the environment.
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_ENV]
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402 (after the XLA flags)
import pytest  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import models, pre_tokenizers, trainers  # noqa: E402

CHAT_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

if os.environ.get(_CACHE_ENV):
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  del config
  if _CACHE_OWNER is not None:
    shutil.rmtree(_CACHE_OWNER, ignore_errors=True)


def _write_tokenizer(directory, *, chat_template=CHAT_TEMPLATE):
  tok = tokenizers.Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  corpus = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
    "How many clips did Natalia sell altogether? #### 72 \\boxed{72} the answer is 1,234.5",
    "Let's think step by step and output the final answer after",
  ] * 10
  tok.train_from_iterator(corpus, trainer)
  tok.save(str(directory / "tokenizer.json"))
  config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
  if chat_template is not None:
    config["chat_template"] = chat_template
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  return directory


@pytest.fixture
def policy_loss_registry():
  """Restores rlx.objectives' loss registry (its entries, in order) after a test that registers.

  From the first entry that differs on, the test's entries are unregistered and
  the saved ones registered again (the built-ins, first, never differ).
  """
  from rlx import objectives  # noqa: PLC0415

  saved = list(objectives.POLICY_LOSS_SPECS.items())
  yield
  now = list(objectives.POLICY_LOSS_SPECS.items())
  same = 0
  while same < min(len(saved), len(now)) and saved[same] == now[same]:
    same += 1
  for name, _ in now[same:]:
    objectives.unregister_policy_loss(name)
  for name, spec in saved[same:]:
    objectives.register_policy_loss(
      name,
      spec.fn,
      extra_inputs=spec.extra_inputs,
      clip_keywords=spec.clip_keywords,
      default_agg=spec.default_agg,
      differentiable_entropy=spec.differentiable_entropy,
    )
  assert list(objectives.POLICY_LOSS_SPECS.items()) == saved


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory):
  return _write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def plain_tokenizer_dir(tmp_path_factory):
  """The same vocabulary without a chat template (a base model)."""
  return _write_tokenizer(tmp_path_factory.mktemp("tok_plain"), chat_template=None)
