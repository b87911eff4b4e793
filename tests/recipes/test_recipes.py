"""The GPT-2 and BERT recipes: tokenizers, token cache, data errors, models, and short training runs on CPU.

The training runs go through each recipe's real ``train.py`` CLI and its ``cpu-tiny.yaml``, shrunk on
the command line (1-2 layers, d=64, seq 32) so that the whole file stays well under 90 s on 2 cores.
"""

from __future__ import annotations

import csv
import fnmatch
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from recipes.bert import train as bert_train
from recipes.bert.data import BertDataModule
from recipes.bert.model import TENSOR_PARALLEL_PLAN as BERT_PLAN
from recipes.bert.model import Bert, BertConfig
from recipes.common import cache, corpus
from recipes.common.flops import transformer_training_flops
from recipes.common.tokenizer import BERT_VOCAB_SIZE, GPT2_VOCAB_SIZE, get_tokenizer
from recipes.gpt2 import train as gpt2_train
from recipes.gpt2.data import GPT2DataModule
from recipes.gpt2.model import GPT, GPTConfig
from recipes.gpt2.model import TENSOR_PARALLEL_PLAN as GPT_PLAN
from recipes.gpt2.module import GPT2LM

ROOT = Path(__file__).resolve().parents[2]

TINY_GPT = [
    "--model.config.n_layer=2",
    "--model.config.n_head=2",
    "--model.config.n_embd=64",
    "--model.config.block_size=32",
    "--data.seq_len=32",
]
TINY_BERT = [
    "--model.config.n_layer=1",
    "--model.config.n_head=2",
    "--model.config.hidden=64",
    "--model.config.intermediate=128",
    "--model.config.max_position=32",
    "--data.seq_len=32",
]


@pytest.fixture
def text_dir(tmp_path) -> Path:
    """A directory with two small text files, ~20 paragraphs each: enough for a train/val split."""
    for name in ("a.txt", "b.md"):
        paragraphs = [
            f"Paragraph {i} of {name}. " + "The quick brown fox jumps over the lazy dog. " * 12 for i in range(20)
        ]
        (tmp_path / name).write_text("\n\n".join(paragraphs))
    return tmp_path


def test_tokenizers_have_the_real_vocabularies():
    gpt2, bert = get_tokenizer("gpt2"), get_tokenizer("bert-uncased")
    assert (gpt2.vocab_size, bert.vocab_size) == (GPT2_VOCAB_SIZE, BERT_VOCAB_SIZE) == (50257, 30522)
    assert gpt2.encode_batch(["Hello world"]) == [[15496, 995]]  # ids of the original GPT-2 BPE
    assert gpt2.eot_id == 50256
    assert (bert.pad_id, bert.unk_id, bert.cls_id, bert.sep_id, bert.mask_id) == (0, 100, 101, 102, 103)
    assert bert.decode(bert.encode_batch(["Hello, WORLD!"])[0]) == "hello, world!"


def test_pieces_rejoin_to_the_text_and_respect_the_limit():
    text = "\n\n".join(f"paragraph {i} " + "x" * (i * 37 % 500) for i in range(300))
    pieces = corpus.split_into_pieces(text, limit=1000)
    assert "".join(pieces) == text
    assert len(pieces) > 5 and all(len(p) >= 1000 for p in pieces[:-1])


def test_validation_split_is_deterministic_and_order_independent():
    hashes = [cache._piece_hash(f"piece {i}") for i in range(200)]
    val = cache.choose_val(hashes, 0.1)
    assert len(val) == 20
    reordered = list(reversed(hashes))
    assert {hashes[i] for i in val} == {reordered[i] for i in cache.choose_val(reordered, 0.1)}
    assert len(cache.choose_val(hashes[:3], 0.01)) == 1  # at least one validation piece...
    assert len(cache.choose_val(hashes[:2], 0.99)) == 1  # ...and at least one training piece
    with pytest.raises(ValueError, match="1 piece"):
        cache.choose_val(hashes[:1], 0.1)


def test_cache_is_built_once_and_reused(text_dir, tmp_path, monkeypatch):
    tok = get_tokenizer("gpt2")
    folder = cache.build([str(text_dir)], tok, tok.eot_id, 0.1, tmp_path / "c")
    train, val = cache.load(folder, "train"), cache.load(folder, "val")
    assert train.dtype == val.dtype == "uint16" and len(train) > 0 and len(val) > 0
    text = "".join(p.text for p in corpus.pieces([str(text_dir)]))
    decoded = "".join(tok.decode(list(split)).replace("<|endoftext|>", "") for split in (train, val))
    assert sorted(decoded) == sorted(text)  # every character kept, on one side of the split
    # a second build must not tokenize again: make tokenizing fail and expect the same folder back
    monkeypatch.setattr(type(tok), "encode_batch", lambda *a: pytest.fail("re-tokenized a cached corpus"))
    assert cache.build([str(text_dir)], tok, tok.eot_id, 0.1, tmp_path / "c") == folder
    assert cache.token_dtype(50257).name == "uint16" and cache.token_dtype(70000).name == "uint32"


def test_bad_data_path_empty_corpus_and_small_split(tmp_path, cache_dir):
    with pytest.raises(ValueError, match="no such file or directory"):
        GPT2DataModule(sources=[str(tmp_path / "missing.txt")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no \.txt/\.md files"):
        GPT2DataModule(sources=[str(tmp_path / "empty")])
    (tmp_path / "empty" / "blank.txt").write_text("  \n\n ")
    data = GPT2DataModule(sources=[str(tmp_path / "empty")], cache_dir=str(cache_dir))
    with pytest.raises(ValueError, match="0 piece"):
        data.prepare_data()
    (tmp_path / "small.txt").write_text("\n\n".join(["a paragraph of words " * 200] * 3))  # 3 pieces
    data = GPT2DataModule(sources=[str(tmp_path / "small.txt")], seq_len=2048, cache_dir=str(cache_dir))
    with pytest.raises(ValueError, match="split .* fewer than the 2049 one sample of seq_len 2048"):
        data.setup("fit")


def test_sequence_longer_than_the_context_fails_before_training(cache_dir, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    config = str(ROOT / "recipes/gpt2/configs/cpu-tiny.yaml")
    args = ["fit", "--config", config, *TINY_GPT, "--data.seq_len=64", f"--data.cache_dir={cache_dir}"]
    with pytest.raises(ValueError, match=r"data.seq_len\(64\) is above the model's context config.block_size\(32\)"):
        gpt2_train.main(args)
    with pytest.raises(ValueError, match="not divisible by n_head"):
        GPTConfig(n_embd=100, n_head=3)


def test_gpt2_layers_tied_head_init_and_tensor_parallel_plan():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=32)).eval()
    ids = torch.randint(0, 97, (2, 11))
    chained = ids
    for layer in model.to_layers():
        chained = layer(chained)
    torch.testing.assert_close(chained, model(ids))
    assert model.head.lm_head.weight is model.embed.wte.weight
    # GPT-2 init: std 0.02, residual projections 0.02/sqrt(2*n_layer); loose bounds (32x32 sample)
    assert abs(model.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.003
    assert abs(model.h[0].mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(6)) < 0.002
    _check_plan(model, GPT_PLAN)


def test_bert_layers_tied_decoder_and_tensor_parallel_plan():
    torch.manual_seed(0)
    model = Bert(BertConfig(vocab_size=101, max_position=16, n_layer=2, n_head=2, hidden=32, intermediate=64, nsp=True))
    model.eval()
    ids = torch.randint(0, 101, (2, 9))
    chained = ids
    for layer in model.to_layers():
        chained = layer(chained)
    labels = torch.full_like(ids, -100)
    labels[:, 3] = 5
    mlm, nsp = model(ids, labels)
    torch.testing.assert_close(chained[:, 3], mlm)
    assert nsp.shape == (2, 2) and model.mlm_head.decoder.weight is model.embed.word.weight
    _check_plan(model, BERT_PLAN)


def _check_plan(model: nn.Module, plan: dict[str, str]) -> None:
    names = [n for n, _ in model.named_modules() if n]
    assert set(plan.values()) <= {"column", "row", "vocab", "replicate", "sequence", "sequence_scatter"}
    for pattern in plan:  # every pattern names real modules
        assert fnmatch.filter(names, pattern), pattern
    for name, module in model.named_modules():  # every Linear is planned, and only once
        if isinstance(module, nn.Linear):
            assert sum(fnmatch.fnmatch(name, p) for p in plan) == 1, name


def test_flops_formula_matches_torch_flop_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    config = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
    model, ids = GPT(config), torch.randint(0, 512, (3, 64))
    # the math backend runs attention as bmm, which the counter sees (the CPU flash kernel it does not)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        GPT.loss_fn(model(ids), ids).backward()
    formula = transformer_training_flops(
        batch=3, seq=64, n_layer=2, d_model=64, d_ff=256, vocab=512, head_positions=3 * 64
    )
    # both count matmuls only, so they agree exactly
    assert formula == counter.get_total_flops()


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("gpt2/configs/gpt2-124m.yaml", 124.4e6),
        ("gpt2/configs/gpt2-350m.yaml", 354.8e6),
        ("gpt2/configs/gpt2-774m.yaml", 774.0e6),
        ("gpt2/configs/gpt2-1.5b.yaml", 1557.6e6),
        ("bert/configs/bert-base.yaml", 109.5e6),
        ("bert/configs/bert-large.yaml", 335.1e6),
    ],
)
def test_gpu_configs_parse_and_have_the_published_sizes(path, params, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    from recipes.common.cli import RecipeCLI

    recipe = gpt2_train if path.startswith("gpt2") else bert_train
    module, data = (GPT2LM, GPT2DataModule) if recipe is gpt2_train else (bert_train.BertMLM, BertDataModule)
    # the GPU trainer cannot be built here: parse the whole file, then swap in a CPU trainer
    args = [
        "--config",
        str(ROOT / "recipes" / path),
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        "--trainer.precision=32-true",
        "--trainer.logger=false",
    ]
    cli = RecipeCLI(module, data, run=False, args=args)
    with torch.device("meta"):  # the published sizes without allocating them
        cli.model.configure_model()
    n = cli.model.model.num_params() if recipe is bert_train else cli.model.model.num_params(False)
    # within 0.2%: the configs pad the vocabulary (50,304 / 30,528 rows) for aligned matmuls
    assert n == pytest.approx(params, rel=2e-3)
    cli.model.check_data(cli.datamodule)  # sequence length within the context


def test_bert_masking_follows_bert_and_validation_masks_are_fixed(cache_dir):
    data = BertDataModule(sources=["shakespeare"], seq_len=64, nsp=True, cache_dir=str(cache_dir))
    data.prepare_data()
    data.setup("fit")
    tok = data.tokenizer
    item = data.val_set[3]
    assert torch.equal(item["input_ids"], data.val_set[3]["input_ids"])  # fixed validation masks
    assert item["input_ids"].shape == item["labels"].shape == item["token_type_ids"].shape == (64,)
    ids = item["input_ids"]
    assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id and (ids == tok.sep_id).sum() >= 2
    masked = torch.stack([data.train_set[i]["labels"] != -100 for i in range(200)])
    assert masked.float().mean().item() == pytest.approx(0.15 * 61 / 64, abs=0.01)
    assert not masked[:, 0].any()  # [CLS] is never a target
    labels = torch.stack([data.train_set[i]["next_sentence_label"] for i in range(200)])
    assert 0.3 < labels.float().mean().item() < 0.7


def _metrics(trainer) -> list[dict[str, str]]:
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _run(
    train_module,
    config: str,
    tmp_path: Path,
    cache_dir: Path,
    extra: list[str],
    monkeypatch,
    checkpoint: dict | None = None,
):
    """Fit through the recipe's CLI with its config, outputs under ``tmp_path``, a 2-batch throughput
    window; ``checkpoint`` overrides ModelCheckpoint's arguments."""
    settings = yaml.safe_load((ROOT / config).read_text())
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c["init_args"] for c in settings["trainer"]["callbacks"]}
    callbacks["TokenThroughputMonitor"]["window_size"] = 2
    callbacks["ModelCheckpoint"]["dirpath"] = str(tmp_path / "ckpt")
    callbacks["ModelCheckpoint"].update(checkpoint or {})
    settings["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(settings))
    args = [
        "fit",
        "--config",
        str(tmp_path / "config.yaml"),
        f"--data.cache_dir={cache_dir}",
        "--data.sources=[shakespeare]",
        "--trainer.devices=1",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=2",
        "--data.batch_size=4",
        *extra,
    ]
    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI warns when pytest's own argv is present
    return train_module.main(args).trainer


def test_gpt2_recipe_trains_logs_throughput_and_resumes(tmp_path, cache_dir, monkeypatch):
    trainer = _run(
        gpt2_train,
        "recipes/gpt2/configs/cpu-tiny.yaml",
        tmp_path,
        cache_dir,
        [*TINY_GPT, "--trainer.max_steps=4"],
        monkeypatch,
    )
    rows = _metrics(trainer)
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(50257), rel=0.05)  # a fresh model is ~uniform
    assert any(r.get("val_loss") for r in rows) and any(r.get("val_ppl") for r in rows)
    assert any(r.get("train/device/items_per_sec") for r in rows)  # tokens/s
    assert any(r.get("train/device/flops_per_sec") for r in rows)
    assert (tmp_path / "ckpt" / "last.ckpt").exists()  # a folder of shards under zero2, a file otherwise
    resumed = _run(
        gpt2_train,
        "recipes/gpt2/configs/cpu-tiny.yaml",
        tmp_path,
        cache_dir,
        [*TINY_GPT, "--trainer.max_steps=6", "--ckpt_path=last"],
        monkeypatch,
    )
    assert resumed.global_step == 6 and len([r for r in _metrics(resumed) if r.get("train_loss")]) == 2


def test_bert_recipe_trains_with_nsp_and_lamb(tmp_path, cache_dir, monkeypatch):
    trainer = _run(
        bert_train,
        "recipes/bert/configs/cpu-tiny.yaml",
        tmp_path,
        cache_dir,
        [
            *TINY_BERT,
            "--trainer.max_steps=3",
            "--model.config.nsp=true",
            "--data.nsp=true",
            "--model.optimizer.name=lamb",
            "--trainer.strategy=zero2",
        ],
        monkeypatch,
    )
    rows = _metrics(trainer)
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(30522) + math.log(2), rel=0.05)  # uniform MLM + NSP
    assert any(r.get("val_mlm_acc") for r in rows)
    assert type(trainer.optimizers[0]).__name__ == "CPULamb"


def test_gpt2_module_without_a_trainer():
    module = GPT2LM(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=1, n_embd=8))
    module.configure_model()
    assert module(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 64)


# BERT only: both recipes share recipes/common/data.py's StatefulDataLoader and sampler, and BERT adds
# the per-window masks and dropout; the GPT-2 run (1.6 min) repeats the shared path (suite time).
@pytest.mark.parametrize("recipe", ["bert"])
def test_recipe_resumes_mid_epoch_exactly(tmp_path, cache_dir, monkeypatch, recipe):
    """A run resumed from a mid-epoch checkpoint (step 3 of 6, with dropout; BERT's masks drawn per
    window and epoch) logs the uninterrupted run's train losses bit for bit: the recipes'
    StatefulDataLoader goes on with the next batch and the checkpoint restores the random states."""
    train, tiny = (gpt2_train, TINY_GPT) if recipe == "gpt2" else (bert_train, TINY_BERT)
    config = f"recipes/{recipe}/configs/cpu-tiny.yaml"
    extra = [*tiny, "--trainer.max_steps=6", "--model.config.dropout=0.1", "--trainer.accumulate_grad_batches=2"]
    every_3 = {"every_n_train_steps": 3, "save_top_k": -1, "monitor": None, "save_last": False}
    (tmp_path / "full").mkdir()
    (tmp_path / "resumed").mkdir()
    full = _run(train, config, tmp_path / "full", cache_dir, extra, monkeypatch, checkpoint=every_3)
    saved = tmp_path / "full" / "ckpt" / "epoch=0-step=3.ckpt"
    assert saved.exists()  # mid-epoch: Shakespeare has hundreds of batches of 4 x 32 tokens
    resumed = _run(train, config, tmp_path / "resumed", cache_dir, [*extra, f"--ckpt_path={saved}"], monkeypatch)

    def losses(trainer) -> dict[str, str]:
        return {r["step"]: r["train_loss"] for r in _metrics(trainer) if r.get("train_loss")}

    before, after = losses(full), losses(resumed)
    assert len(before) == 6 and sorted(after) == sorted(k for k in before if int(k) >= 3)
    # The logged strings are Python's shortest round-trip repr: equal strings are equal floats.
    assert after == {k: v for k, v in before.items() if k in after}
