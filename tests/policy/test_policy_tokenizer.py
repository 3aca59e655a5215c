"""Tokenizer (HF `tokenizers`, built in the test) and CharTokenizer share one interface."""

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from rlx import policy

CHAT_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  tok = tokenizers.Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  corpus = ["the cat sat on the mat", "2 + 3 = 5", "hello world, the answer is 42"] * 20
  tok.train_from_iterator(corpus, trainer)
  directory = tmp_path_factory.mktemp("tok")
  tok.save(str(directory / "tokenizer.json"))
  config = {
    "eos_token": "<|im_end|>",
    "pad_token": {"content": "<|endoftext|>", "special": True},
    "bos_token": None,
    "chat_template": CHAT_TEMPLATE,
  }
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  return directory


def test_hf_tokenizer(tokenizer_dir):
  tok = policy.Tokenizer(tokenizer_dir)
  assert tok.eos_id == 2 and tok.pad_id == 0 and tok.bos_id is None
  assert tok.eos_ids == (2, 0)
  assert tok.vocab_size == tokenizers.Tokenizer.from_file(
    str(tokenizer_dir / "tokenizer.json")
  ).get_vocab_size(with_added_tokens=True)
  text = "the cat sat on 42 mats"
  ids = tok.encode(text)
  assert all(isinstance(i, int) for i in ids)
  assert tok.decode(ids) == text
  assert tok.decode([*ids, tok.eos_id]) == text
  assert tok.decode([*ids, tok.eos_id], skip_special_tokens=False) == text + "<|im_end|>"
  assert tok.encode_batch(["the cat", "2 + 3"]) == [tok.encode("the cat"), tok.encode("2 + 3")]
  assert tok.decode_batch(np.asarray([tok.encode("the mat")])) == ["the mat"]
  with pytest.raises(ValueError, match="outside"):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError, match="single str"):
    tok.encode_batch("the cat")


def test_chat_template(tokenizer_dir):
  tok = policy.Tokenizer(tokenizer_dir)
  assert tok.has_chat_template
  messages = [{"role": "user", "content": "2 + 3 = ?"}]
  text = tok.apply_chat_template(messages)
  assert text == "<|im_start|>user\n2 + 3 = ?<|im_end|>\n<|im_start|>assistant\n"
  assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
  ids = tok.encode(text)
  vocab = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
  assert ids[0] == vocab.token_to_id("<|im_start|>")  # special tokens map to single ids


def test_template_from_jinja_file_and_missing_template(tokenizer_dir, tmp_path):
  (tmp_path / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
  tok = policy.Tokenizer(tmp_path)
  assert tok.pad_id == tok.eos_id == 0  # no pad token: falls back to eos
  assert not tok.has_chat_template
  with pytest.raises(ValueError, match="chat template"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
  assert policy.Tokenizer(tmp_path).apply_chat_template([{"role": "u", "content": "hi"}]) == "hi!"
  with pytest.raises(ValueError, match="tokenizer.json"):
    policy.Tokenizer(tmp_path / "nowhere")


def test_char_tokenizer():
  tok = policy.CharTokenizer("0123456789+=")
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 15)
  ids = tok.encode("12+3=15")
  assert ids == [4, 5, 13, 6, 14, 4, 8]
  assert tok.encode("1", add_special_tokens=True) == [1, 4]
  assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == "12+3=15"
  assert tok.decode([1, 4, 2], skip_special_tokens=False) == "<bos>1<eos>"
  assert tok.apply_chat_template([{"role": "user", "content": "1+1"}]) == "user: 1+1\nassistant: "
  with pytest.raises(ValueError, match=r"\['x'\]"):
    tok.encode("1x")
  with pytest.raises(ValueError, match="repeated"):
    policy.CharTokenizer("aa")


@pytest.mark.parametrize("kind", ["char", "hf"])
def test_pad_is_right_padding_and_never_truncates(kind, tokenizer_dir):
  tok = policy.CharTokenizer("abc") if kind == "char" else policy.Tokenizer(tokenizer_dir)
  seqs = [tok.encode("abc"), tok.encode("a")]
  ids, mask = tok.pad(seqs)
  assert ids.dtype == np.int32 and ids.shape == mask.shape == (2, len(seqs[0]))
  np.testing.assert_array_equal(mask.sum(1), [len(seqs[0]), len(seqs[1])])
  assert np.all(ids[1, len(seqs[1]) :] == tok.pad_id)
  assert tok.pad(seqs, length=8)[0].shape == (2, 8)
  with pytest.raises(ValueError, match="truncated"):
    tok.pad(seqs, length=len(seqs[0]) - 1)


@pytest.mark.parametrize("kind", ["char", "hf"])
def test_bad_ids_and_batches_name_the_argument(kind, tokenizer_dir):
  tok = policy.CharTokenizer("0123456789+=") if kind == "char" else policy.Tokenizer(tokenizer_dir)
  ids = tok.encode("12")
  assert tok.decode(np.asarray(ids)) == tok.decode(ids) == "12"  # arrays of ints are fine
  # int(4.5) would silently truncate; a nested list, a string or a bool is a mistake.
  for bad, match in [
    ([4.5], "`ids` must hold int token ids, got 4.5 at index 0"),
    ([True], "`ids` must hold int token ids"),
    ("12", "`ids` must be a 1-D sequence"),
    (np.array([[4, 5]]), r"`ids` must be 1-D token ids, got an array of shape \(1, 2\)"),
    (np.array([4.0]), "`ids` must hold int token ids, got dtype float"),
  ]:
    with pytest.raises(ValueError, match=match):
      tok.decode(bad)
  with pytest.raises(ValueError, match="`batch` must be a sequence of token-id sequences"):
    tok.decode_batch(ids)
  assert tok.decode_batch(np.asarray([ids, ids])) == ["12", "12"]
  # pad: at least one sequence, int ids, an int length.
  for bad, match in [
    ([], r"`sequences` must hold at least one sequence \(B >= 1\)"),
    ("12", "`sequences` must be a list of token-id lists"),
    ([[4, [5]]], r"`sequences\[0\]` must hold int token ids"),
    ([[4.5]], r"`sequences\[0\]` must hold int token ids"),
  ]:
    with pytest.raises(ValueError, match=match):
      tok.pad(bad)
  for length in (-1, 2.0, True):
    with pytest.raises(ValueError, match="`length` must be None or an int >= 0"):
      tok.pad([ids], length=length)
  with pytest.raises(ValueError, match="`texts` must be a sequence of strings"):
    tok.encode_batch(123)
  # Chat messages: a list of dicts with a str role.
  for bad, match in [
    ("hi", "`messages` must be a list of"),
    ({"role": "user", "content": "hi"}, "`messages` must be a list of"),
    (["hi"], r"`messages\[0\]` must be a dict with a str 'role'"),
  ]:
    with pytest.raises(ValueError, match=match):
      tok.apply_chat_template(bad)
  with pytest.raises(ValueError, match="`path` must be a str or os.PathLike"):
    policy.Tokenizer(None)
