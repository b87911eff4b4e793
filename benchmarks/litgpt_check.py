"""LitGPT's own finetune scripts under Fabric's ZeroStrategy, against Fabric's DDP (2 CPU ranks, fp32).

LitGPT (``pip install --no-deps litgpt==0.5.13 psutil``) hard-codes ``FSDPStrategy`` for more than one
device; this check swaps it at run time for ``lightning_zero.fabric.ZeroStrategy(stage=N,
state_dict_type="full")`` (or Fabric's ``"ddp"`` for the reference) and runs
``litgpt.finetune.full.setup`` unchanged on a 2-layer LLaMA-shaped model with random weights, a
word-level tokenizer trained here and a JSON instruction data set made here (nothing is downloaded).
The script exercises what LitGPT does: ``init_module(empty_init=True)``, ``fabric.setup(model)``,
``setup_optimizers`` of an optimizer over the set-up model's parameters, ``model.load_state_dict`` of
the "pretrained" ``lit_model.pth`` (its ``load_checkpoint`` for non-FSDP strategies), ``fabric.save``
of the state every ``save_interval`` steps, a final model-only save, and a resume from the step
checkpoint. ``--script lora`` runs ``litgpt/finetune/lora.py`` (its ``ModelParallelStrategy``
swapped the same way; frozen base, ``setup_module`` then ``setup_optimizers`` of an optimizer over
all parameters, a final LoRA save through ``model.state_dict()``, then LitGPT's ``merge_lora``). It
prints each run's losses (LitGPT's CSV log), their largest relative difference from DDP's, and the
largest difference of the final weights (``final/lit_model.pth`` or ``lit_model.pth.lora``, one file
``torch.load`` reads). ``--script pretrain`` runs ``litgpt/pretrain.py`` (its ``FSDPStrategy``
swapped the same way): ``init_module(empty_init=True)`` then LitGPT's ``initialize_weights`` on the
model before setup, ``torch.compile``, ``fabric.setup(model)`` then ``setup_optimizers``,
``clip_gradients``, a ``TextFiles`` data set made here (litdata's ``StreamingDataLoader``, whose state
goes into every checkpoint), 4 steps of 2 accumulated iterations, checkpoints every 2 steps; then a
resume from step 2 to the end (the later checkpoints removed). Needs ``pip install --no-deps litdata``.

    PYTHONPATH=$PWD python benchmarks/litgpt_check.py            # stages 1, 2, 3
    PYTHONPATH=$PWD python benchmarks/litgpt_check.py --stages 3 --offload   # offload_optimizer="cpu"
    PYTHONPATH=$PWD python benchmarks/litgpt_check.py --script lora          # finetune/lora.py (no resume)
    PYTHONPATH=$PWD python benchmarks/litgpt_check.py --script pretrain      # pretrain.py (+ resume)

Takes about a minute per stage on 2 CPU cores. Not part of the test suite (LitGPT is not a test
dependency); ``tests/distributed/test_fabric_programs.py`` holds a LitGPT-like program that is.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_zero.testing import run_ranks

WORDS = [
    "the",
    "a",
    "model",
    "learns",
    "to",
    "answer",
    "short",
    "questions",
    "about",
    "colors",
    "numbers",
    "animals",
    "and",
    "plants",
]


def _make_checkpoint(root: Path) -> Path:
    """A LitGPT checkpoint directory: config, random weights, a word-level tokenizer."""
    from litgpt import GPT, Config
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    ckpt = root / "checkpoint"
    ckpt.mkdir(parents=True)
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.WordLevelTrainer(special_tokens=special)
    text = [" ".join(WORDS)] + [
        "Below is an instruction that describes a task . Write a response that appropriately completes the request ."
        " ### Instruction : ### Input : ### Response : Response Instruction Input"
    ]
    tokenizer.train_from_iterator(text, trainer)
    tokenizer.save(str(ckpt / "tokenizer.json"))
    special_tokens = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(special_tokens))
    vocab = tokenizer.get_vocab_size()
    config = Config(
        name="tiny-llama",
        block_size=64,
        vocab_size=vocab,
        padded_vocab_size=vocab + (-vocab % 8),
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=32,
        intermediate_size=72,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        parallel_residual=False,
        rotary_percentage=1.0,
    )
    save_config(config, ckpt)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), ckpt / "lit_model.pth")
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(48):
        pick = torch.randint(0, len(WORDS), (8,), generator=generator).tolist()
        words = [WORDS[i] for i in pick]
        rows.append({"instruction": " ".join(words[:4]), "input": "", "output": " ".join(words[4:])})
    (root / "data.json").write_text(json.dumps(rows))
    return ckpt


def _run(
    rank: int, root: str, name: str, stage: int | None, resume: bool, script: str = "full", offload: bool = False
) -> None:
    import sys

    import litgpt.finetune.full as full
    import litgpt.finetune.lora as lora
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON

    import lightning_zero  # noqa: F401 - registers the names
    from lightning_zero.fabric import ZeroStrategy

    def strategy(**_: Any) -> Any:  # instead of what LitGPT builds for devices > 1
        if stage is None:
            return "ddp"
        return ZeroStrategy(stage=stage, state_dict_type="full", **({"offload_optimizer": "cpu"} if offload else {}))

    full.FSDPStrategy = strategy
    lora.ModelParallelStrategy = strategy
    if script == "lora":
        # LitGPT's LoRA builds the model under init_module(empty_init=True) and relies on its
        # ModelParallelStrategy to initialize what the base checkpoint lacks (the LoRA matrices); under
        # any other strategy (DDP too) they would keep uninitialized memory. Build them initialized.
        from lightning.fabric import Fabric

        init_module = Fabric.init_module
        Fabric.init_module = lambda self, empty_init=None: init_module(self, empty_init=False)  # type: ignore[method-assign]
    out = Path(root) / name
    # LitGPT saves its "hyperparameters" by parsing the command line as its own CLI's: give it one
    # (merge_lora reads the LoRA shape back from it)
    sys.argv = [sys.argv[0], str(Path(root) / "checkpoint")]
    if script == "lora":
        sys.argv += ["--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0"]
    extra: dict[str, Any] = (
        {"resume": resume} if script == "full" else {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
    )
    # LoRA: LitGPT generates a sample on rank 0 alone at its initial and interval validations (a
    # stage-3 forward the other rank does not run: ZeroStrategy refuses it), both off here.
    (full if script == "full" else lora).setup(
        Path(root) / "checkpoint",
        out_dir=out,
        precision="32-true",
        devices=2,
        **extra,
        data=JSON(json_path=Path(root) / "data.json", val_split_fraction=0.25, num_workers=0),
        train=TrainArgs(
            save_interval=2,
            log_interval=1,
            global_batch_size=4,
            micro_batch_size=2,
            lr_warmup_steps=1,
            epochs=1,
            max_steps=4 if resume or script == "lora" else 2,
            max_seq_length=64,
        ),
        eval=EvalArgs(interval=1000, max_new_tokens=4, max_iters=1, initial_validation=False, final_validation=False),
        logger_name="csv",
        optimizer="AdamW",
        seed=1337,
    )


def _make_text(root: Path) -> Path:
    """Plain-text files for LitGPT's ``TextFiles`` data module (its first file is the validation split)."""
    text = root / "text"
    text.mkdir()
    generator = torch.Generator().manual_seed(2)
    for index in range(4):
        pick = torch.randint(0, len(WORDS), (400,), generator=generator).tolist()
        (text / f"part{index}.txt").write_text(" ".join(WORDS[i] for i in pick))
    return text


def _run_pretrain(rank: int, root: str, name: str, stage: int | None, resume: bool, offload: bool) -> None:
    import sys

    import litgpt.pretrain as pretrain
    from litgpt import Config
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import TextFiles

    from lightning_zero.fabric import ZeroStrategy

    class Swapped:  # instead of LitGPT's FSDPStrategy for devices > 1 (a class: LitGPT checks isinstance)
        def __new__(cls, **_: Any) -> Any:
            if stage is None:
                return "ddp"
            options = {"offload_optimizer": "cpu"} if offload else {}
            return ZeroStrategy(stage=stage, state_dict_type="full", **options)

    pretrain.FSDPStrategy = Swapped
    sys.argv = [sys.argv[0], "tiny-llama"]  # LitGPT saves its hyperparameters by parsing its command line
    checkpoint = Path(root) / "checkpoint"
    # 8 iterations of 1 sequence of 32 tokens per rank, 2 accumulated per step (global batch 4): 4 steps,
    # a checkpoint every 2; the resume starts from step 2 (its data loader state) after the later ones
    # are removed.
    pretrain.setup(
        "tiny-llama",
        model_config=Config.from_file(checkpoint / "model_config.yaml"),
        out_dir=Path(root) / name,
        precision="32-true",
        resume=resume,
        data=TextFiles(train_data_path=Path(root) / "text", num_workers=0),
        train=TrainArgs(
            save_interval=2,
            log_interval=1,
            global_batch_size=4,
            micro_batch_size=1,
            max_tokens=2 * 8 * 32,
            max_norm=1.0,
            min_lr=1e-5,
            lr_warmup_steps=1,
            max_seq_length=32,
        ),
        eval=EvalArgs(interval=1000, max_iters=1, initial_validation=False, final_validation=False),
        devices=2,
        tokenizer_dir=checkpoint,
        logger_name="csv",
        seed=1337,
    )


def _pretrain_and_resume(root: Path, name: str, stage: int | None, offload: bool) -> None:
    """The whole pretraining run, then a resume from its step-2 checkpoint to the end (the later
    checkpoints and the first run's log removed: the losses compared are the resumed run's)."""
    import shutil

    if not (root / "text").exists():
        _make_text(root)
    run_ranks(_run_pretrain, str(root), name, stage, False, offload, timeout=900)
    out = root / name
    first = torch.load(out / "final" / "lit_model.pth", weights_only=True)["model"]
    losses = _losses(out)
    shutil.rmtree(out / "step-00000004")
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "logs")
    run_ranks(_run_pretrain, str(root), name, stage, True, offload, timeout=900)
    resumed = torch.load(out / "final" / "lit_model.pth", weights_only=True)["model"]
    (out / "losses.json").write_text(json.dumps(losses + _losses(out)))
    gap = max((resumed[k] - v).abs().max().item() for k, v in first.items())
    print(f"{name}: final weights of the resumed run vs the uninterrupted one: max diff {gap:.2e}")


def _losses(out: Path) -> list[float]:
    if (out / "losses.json").exists():  # pretrain: the first run's, then the resumed run's
        return [float(x) for x in json.loads((out / "losses.json").read_text())]
    rows: list[dict[str, Any]] = []
    for path in sorted(out.glob("logs/csv/**/metrics.csv")):
        with path.open() as f:
            rows += [r for r in csv.DictReader(f) if r.get("loss")]
    return [float(r["loss"]) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--script", choices=["full", "lora", "pretrain"], default="full")
    parser.add_argument("--offload", action="store_true", help='ZeroStrategy(offload_optimizer="cpu")')
    args = parser.parse_args()
    final = "lit_model.pth.lora" if args.script == "lora" else "lit_model.pth"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _make_checkpoint(root)
        runs: list[tuple[str, int | None]] = [("ddp", None)] + [(f"zero{s}", s) for s in args.stages]
        for name, stage in runs:
            if args.script == "pretrain":
                _pretrain_and_resume(root, name, stage, args.offload)
                continue
            run_ranks(_run, str(root), name, stage, False, args.script, args.offload, timeout=900)
            if args.script == "full":  # resume from step-000002
                run_ranks(_run, str(root), name, stage, True, args.script, args.offload, timeout=900)
        ref_losses = _losses(root / "ddp")
        ref = torch.load(root / "ddp" / "final" / final, weights_only=True)["model"]
        print(f"ddp losses: {[round(x, 6) for x in ref_losses]}")
        for name, _ in runs[1:]:
            losses = _losses(root / name)
            weights_of = torch.load(root / name / "final" / final, weights_only=True)["model"]
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
            weights = max((weights_of[k].float() - v.float()).abs().max().item() for k, v in ref.items())
            print(
                f"{name}: {len(losses)} losses, max relative loss diff {rel:.2e}, max final weight diff {weights:.2e}"
            )


if __name__ == "__main__":
    main()
