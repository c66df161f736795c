"""Math problems as (question, answer) records: from local DAPO-Math-17k, UltraData-RL or GSM8K files,
from a hub dataset when huggingface_hub is installed, or generated (GSM8K-style word problems).

The file type comes from the suffix (.parquet, .jsonl, .json: one array of rows); the row layout from
`format`:
- "dapo": prompt = [{role, content}, ...] (the last user message is the question, with DAPO's own
  instruction in it), reward_model.ground_truth.
- "ultradata": query, ground_truth; `domain` keeps only rows of that domain (e.g. "Math").
- "gsm8k": question, answer ending in "#### 42" (the number after "####", commas removed).
Repeated (question, answer) pairs are kept once (DAPO-Math-17k repeats each problem about 100 times).
"""

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshy.dataplane import SchemaError
from meshy.recipes.weights.hub import download_error

FORMATS = ("dapo", "ultradata", "gsm8k")
SUFFIXES = (".parquet", ".jsonl", ".json")
_BATCH_ROWS = 65_536


@dataclass(frozen=True)
class Record:
    question: str
    answer: str


def load_records(source: str, format: str, domain: str | None = None) -> list[Record]:
    """Every distinct record of a file (or hub dataset "owner/name[:path/in/repo]"), in file order."""
    if format not in FORMATS:
        raise SchemaError(f"format: unknown data format {format!r}; expected one of {FORMATS}")
    if domain is not None and format != "ultradata":
        raise SchemaError(f'domain: only the "ultradata" format has domains, got format {format!r}')
    path = resolve_source(source)
    parse, columns = _PARSERS[format]
    records = {}
    for i, row in enumerate(_rows(path, (*columns, "domain") if domain else columns)):
        where = f"{path}: row {i}"
        if not isinstance(row, dict):
            raise SchemaError(f"{where}: expected an object, got {type(row).__name__}")
        if domain is not None and _text(row, "domain", where) != domain:
            continue
        records.setdefault(parse(row, where), None)
    if not records:
        raise SchemaError(f"{path}: no {format} records" + (f" of domain {domain!r}" if domain else ""))
    return list(records)


def resolve_source(source: str) -> Path:
    """A local file, or a hub dataset file downloaded with huggingface_hub (optional, needs network)."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.exists():
        raise SchemaError(f"source: {source} is not a file")
    repo, _, filename = source.partition(":")
    if repo.endswith(SUFFIXES) or repo.startswith(("/", ".", "~")) or repo.count("/") != 1:
        raise SchemaError(f"source: no file {source} (nor a hub dataset name 'owner/name[:path]')")
    try:
        import huggingface_hub
    except ImportError:
        raise SchemaError(
            f"source: no file {source}; hub dataset names need the optional huggingface_hub package and network"
        ) from None
    try:
        if not filename:
            files = [f for f in huggingface_hub.list_repo_files(repo, repo_type="dataset") if f.endswith(SUFFIXES)]
            if len(files) != 1:
                raise SchemaError(f"source: hub dataset {repo} has data files {files}; name one as '{repo}:<path>'")
            filename = files[0]
        return Path(huggingface_hub.hf_hub_download(repo, filename, repo_type="dataset"))
    except SchemaError:
        raise
    except Exception as e:
        raise download_error(f"source: no file {source}, and downloading it from the hub failed", e) from None


def _rows(path: Path, columns: tuple[str, ...]) -> Iterator[Any]:
    """Rows as parsed JSON, or parquet rows holding only `columns` (DAPO-Math-17k has 1.8M rows)."""
    if path.suffix == ".parquet":
        yield from _parquet_rows(path, columns)
    elif path.suffix == ".jsonl":
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield _json(line, f"{path}: line {n}")
    elif path.suffix == ".json":
        rows = _json(path.read_text(), str(path))
        if not isinstance(rows, list):
            raise SchemaError(f"{path}: expected a JSON array of rows, got {type(rows).__name__}")
        yield from rows
    else:
        raise SchemaError(f"{path}: unknown file type {path.suffix!r}; expected one of {SUFFIXES}")


def _parquet_rows(path: Path, columns: tuple[str, ...]) -> Iterator[dict]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as e:
        raise SchemaError(f"{path}: not a readable parquet file ({e})") from None
    missing = [c for c in columns if c not in file.schema_arrow.names]
    if missing:
        raise SchemaError(
            f"{path}: missing field {missing[0]!r} (no such column; columns are {file.schema_arrow.names})"
        )
    for batch in file.iter_batches(batch_size=_BATCH_ROWS, columns=list(columns)):
        yield from batch.to_pylist()


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SchemaError(f"{where}: not valid JSON ({e})") from None


def _field(row: dict, name: str, where: str) -> Any:
    if row.get(name) is None:
        raise SchemaError(f"{where}: missing field {name!r}")
    return row[name]


def _text(row: dict, name: str, where: str) -> str:
    value = _field(row, name, where)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise SchemaError(f"{where}: field {name!r}: expected non-empty text, got {value!r}")
    return value.strip()


def _dapo(row: dict, where: str) -> Record:
    prompt = _field(row, "prompt", where)
    if not isinstance(prompt, list):
        raise SchemaError(f"{where}: field 'prompt': expected a list of {{role, content}}, got {prompt!r}")
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise SchemaError(f"{where}: field 'prompt': expected a message with role 'user', got {prompt!r}")
    reward_model = _field(row, "reward_model", where)
    if not isinstance(reward_model, dict):
        raise SchemaError(f"{where}: field 'reward_model': expected {{ground_truth, ...}}, got {reward_model!r}")
    return Record(_text(users[-1], "content", f"{where}: prompt"), _text(reward_model, "ground_truth", where))


def _ultradata(row: dict, where: str) -> Record:
    return Record(_text(row, "query", where), _text(row, "ground_truth", where))


def _gsm8k(row: dict, where: str) -> Record:
    solution = _text(row, "answer", where)
    final = solution.rpartition("####")[2].strip().replace(",", "")
    if "####" not in solution or not final:
        raise SchemaError(f"{where}: field 'answer': expected a solution ending in '#### <number>', got {solution!r}")
    return Record(_text(row, "question", where), final)


_PARSERS: dict[str, tuple[Callable[[dict, str], Record], tuple[str, ...]]] = {
    "dapo": (_dapo, ("prompt", "reward_model")),
    "ultradata": (_ultradata, ("query", "ground_truth")),
    "gsm8k": (_gsm8k, ("question", "answer")),
}


# ---- generated: GSM8K-style arithmetic word problems, answers are integers ------------------------
_NAMES = ("Tom", "Mia", "Ravi", "Lena", "Omar", "Sofia", "Ken", "Ada", "Luis", "Noor")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "cards")


def generated_records(seed: int) -> Iterator[Record]:
    """An endless, seeded stream of one- and two-step word problems with integer answers."""
    rng = random.Random(seed)
    while True:
        yield rng.choice(_GENERATORS)(rng)


def _boxes(rng: random.Random) -> Record:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    boxes, each = rng.randint(2, 12), rng.randint(2, 15)
    given = rng.randint(0, boxes * each)
    return Record(
        f"{name} has {boxes} boxes with {each} {item} each. {name} gives away {given} {item}. "
        f"How many {item} does {name} have left?",
        str(boxes * each - given),
    )


def _change(rng: random.Random) -> Record:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    count, price = rng.randint(2, 9), rng.randint(1, 12)
    paid = rng.choice([b for b in (20, 50, 100, 200) if b >= count * price])
    return Record(
        f"{name} buys {count} {item} for ${price} each and pays with a ${paid} bill. "
        f"How many dollars of change does {name} get?",
        str(paid - count * price),
    )


def _more_than(rng: random.Random) -> Record:
    first, second = rng.sample(_NAMES, 2)
    item, have, more = rng.choice(_ITEMS), rng.randint(3, 60), rng.randint(1, 40)
    return Record(
        f"{first} has {have} {item}. {second} has {more} more {item} than {first}. "
        f"How many {item} do they have together?",
        str(2 * have + more),
    )


def _share(rng: random.Random) -> Record:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    friends, each, kept = rng.randint(2, 9), rng.randint(2, 12), rng.randint(0, 10)
    return Record(
        f"{name} has {friends * each + kept} {item}, keeps {kept} and shares the rest equally among "
        f"{friends} friends. How many {item} does each friend get?",
        str(each),
    )


def _travel(rng: random.Random) -> Record:
    name, speed, hours, more = rng.choice(_NAMES), rng.randint(20, 70), rng.randint(2, 6), rng.randint(1, 3)
    return Record(
        f"{name} drives at {speed} miles per hour for {hours} hours, then {more} more hour{'s' * (more > 1)} "
        f"at the same speed. How many miles does {name} drive in total?",
        str(speed * (hours + more)),
    )


_GENERATORS = (_boxes, _change, _more_than, _share, _travel)
