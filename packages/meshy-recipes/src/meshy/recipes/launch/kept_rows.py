"""Which of the rows a stopped run's data plane read back from disk its resumed run keeps.

The resumed trainer carries on from the newest complete checkpoint's version v and trains batch v next
(batch b trains into version b + 1; the rollout role writes the same prompts under the same row ids again,
skipping the rows that are still there). Rows are kept or dropped by whole groups (advantages are a
group's), before any role starts:

- a group with a row trained into v or before (metrics.jsonl says which: fully asynchronous pacing trains
  groups as they are ready, not batch by batch);
- a group of a batch the rollout role could not have written yet at v (its pacing: v + W batches, or
  FREE_BATCHES ahead when fully asynchronous) is written again when due, so pacing holds;
- a group the trainer acked was trained after the checkpoint, by versions the resumed run discards: it is
  trained again, from new generations;
- a group with a token generated under a version after v came from a policy the resumed run discards;
- in a multi-turn run, every row of the turns table (the trajectories in progress: their environments'
  state died with the run), and the groups of their rollout rows (taken by the environment role, with no
  response yet), written and played again;
- of a response in progress (sampling.keep_partial_every), the chunks from the first one with a token
  generated under a version after v, and every chunk of a row no longer waiting for its response.

The rest is kept, whatever its batch: prompts still waiting for generation, responses generated under v or before (the
trainer masks tokens older than max_staleness as it always does), and the chunks of responses in progress
before any such token (the inference role continues each row from them). Counts and length figures by reason go
to the records, for `meshy inspect`.
"""

import json
from collections import defaultdict
from pathlib import Path

from meshy.dataplane import DataPlaneClient
from meshy.dataplane import columns as cols
from meshy.recipes.recipe import Recipe
from meshy.recipes.recipe.dataflow import PARTIALS, TURNS, rollout_table
from meshy.recipes.roles.context import KEPT_ROWS_STREAM
from meshy.recipes.roles.rollout import FREE_BATCHES
from meshy.train import checkpoint


def restored_version(run_dir: Path) -> int:
    """The version a resumed run carries on from: the newest complete checkpoint's, or 0."""
    newest = checkpoint.latest(run_dir / "checkpoints")
    return checkpoint.step_of(newest) if newest is not None else 0


def trained_rows(run_dir: Path, version: int) -> tuple[set[int], set[int]]:
    """The rows trained (or dropped by the trainer) into `version` or before, and into the later versions a run
    resumed at `version` discards, from the run's metrics lines."""
    path = run_dir / "metrics.jsonl"
    before, after = set(), set()
    for line in path.read_text().splitlines() if path.is_file() else []:
        m = json.loads(line)
        (before if m["version"] <= version else after).update([*m["row_ids"], *(d["row"] for d in m["dropped"])])
    return before, after


def announce_written(recipe: Recipe, client: DataPlaneClient, version: int, rows: set[int]) -> None:
    """Tell the rollout role the version the run resumed at (its first batch) and which rows of the batches it
    writes again (that version's onward) are not to be written: kept from the stopped run, or trained into
    the restored version already."""
    first = version * recipe.algorithm.prompts_per_step * recipe.algorithm.group_size
    client.append(KEPT_ROWS_STREAM, {"version": version, "rows": sorted(r for r in rows if r >= first)})


def keep_restored_rows(
    recipe: Recipe,
    version: int,
    client: DataPlaneClient,
    tables: list[str],
    trained: set[int],
    trained_after: set[int],
) -> dict:
    """Drop what a run resumed at `version` cannot use from the restored `tables` (`trained`: the rows trained
    into that version or before; `trained_after`: into the versions after it); what was kept and dropped, and
    why, and the rollout rows kept."""
    # response lengths of rows kept (and of those among them a discarded version trained: trained again, not
    # generated again), of prompts kept, and of the responses in progress kept (their chunks so far)
    kept: dict[str, list[int]] = {"kept": [], "retrained": [], "waiting": [], "partial": []}
    lengths: dict[str, list[int]] = defaultdict(list)  # why dropped -> response lengths
    table = rollout_table(recipe).name
    waiting: set[int] = set()  # rows kept with no response yet
    if table in tables:
        rows = client.peek(table, [cols.RESPONSE_IDS, cols.TOKEN_VERSIONS])
        algo = recipe.algorithm
        ahead = algo.window if algo.window is not None else FREE_BATCHES
        reasons = _group_reasons(rows, version, algo.prompts_per_step, ahead, trained)
        dropped = []
        for i, row in enumerate(rows.row_ids):
            response = rows.columns[cols.RESPONSE_IDS][i]
            reason = reasons.get(rows.group_ids[i])
            if reason is not None:
                dropped.append(row)
                lengths[reason].append(_length(response))
            else:
                kept["kept" if response is not None else "waiting"].append(_length(response))
                if response is None:
                    waiting.add(row)
                elif row in trained_after:
                    kept["retrained"].append(_length(response))
        if dropped:
            client.drop(table, dropped)
        gone = set(dropped)
        kept_ids = [r for r in rows.row_ids if r not in gone]
    else:
        kept_ids = []
    if TURNS in tables:
        turns = client.peek(TURNS, [])
        if turns.row_ids:
            client.drop(TURNS, turns.row_ids)
            lengths["a turn of a trajectory in progress (its environment's state died with the run)"] += [0] * len(
                turns
            )
    if PARTIALS in tables:
        _keep_partials(client, version, waiting, kept["partial"], lengths)
    return {
        "version": version,
        **{what: _figures(n) for what, n in kept.items()},
        "dropped": {reason: _figures(n) for reason, n in lengths.items()},
        "rows_kept": kept_ids,
    }


def _group_reasons(rows, version: int, prompts_per_step: int, ahead: int, trained: set[int]) -> dict[int, str]:
    """Why each dropped group goes (groups kept have no entry). ahead: how many batches past the version the
    rollout role writes (the window W, or FREE_BATCHES)."""
    reasons: dict[int, str] = {}
    train = cols.TRAIN_TASK.name
    for i, group in enumerate(rows.group_ids):
        versions = rows.columns[cols.TOKEN_VERSIONS][i]
        batch = group // prompts_per_step
        if rows.row_ids[i] in trained:
            reason = f"trained into v{version} or before, the version resumed from"
        elif batch >= version + ahead:
            reason = f"written ahead of what pacing allows at v{version}: written again when due"
        elif versions is None and rows.done[i]:
            reason = "a trajectory in progress (its environment's state died with the run): played again"
        elif train in rows.done[i]:
            reason = f"trained after the checkpoint of v{version}: trained again, from new generations"
        elif versions is not None and len(versions) and int(versions.max()) > version:
            reason = f"generated under a version after v{version}, which the resumed run discards"
        else:
            continue
        reasons.setdefault(group, reason)
    return reasons


def _keep_partials(
    client: DataPlaneClient, version: int, waiting: set[int], kept: list[int], dropped: dict[str, list[int]]
) -> None:
    """Keep each waiting row's chunks up to the first with a token from after `version`; drop the rest."""
    chunks = client.peek(PARTIALS, [cols.PARTIAL_OF, cols.TOKEN_VERSIONS])
    by_row: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
    for i in sorted(range(len(chunks)), key=lambda i: chunks.row_ids[i]):
        versions = chunks.columns[cols.TOKEN_VERSIONS][i].tolist()
        by_row[int(chunks.columns[cols.PARTIAL_OF][i])].append((chunks.row_ids[i], versions))
    gone, later = [], f"a response in progress: tokens generated under a version after v{version}"
    for row, row_chunks in by_row.items():
        usable = row in waiting
        prefix = 0
        for chunk, versions in row_chunks:
            usable = usable and max(versions, default=0) <= version
            if usable:
                prefix += len(versions)
                continue
            gone.append(chunk)
            reason = later if row in waiting else "a response in progress of a row no longer waiting for one"
            dropped[reason].append(len(versions))
        if prefix:
            kept.append(prefix)
    if gone:
        client.drop(PARTIALS, gone)


def _length(response) -> int:
    return 0 if response is None else len(response)


def _figures(lengths: list[int]) -> dict:
    ordered = sorted(lengths) or [0]
    return {
        "rows": len(lengths),
        "tokens": sum(ordered),
        "length_p50": ordered[len(ordered) // 2],
        "length_p90": ordered[min(len(ordered) - 1, len(ordered) * 9 // 10)],
        "length_max": ordered[-1],
    }


def kept_rows_line(kept: dict) -> str:
    """What a resumed run kept, in one line for its output."""
    line = (
        f"data plane: kept {kept['kept']['rows']} generated rows ({kept['kept']['tokens']} tokens; "
        f"{kept['retrained']['rows']} of them trained again, by versions the resume discards) and "
        f"{kept['waiting']['rows']} prompts waiting for generation ({kept['partial']['rows']} of them with "
        f"{kept['partial']['tokens']} tokens of their responses) from the stopped run, resuming at v{kept['version']}"
    )
    for reason, figures in kept["dropped"].items():
        line += f"; dropped {figures['rows']} rows ({figures['tokens']} tokens): {reason}"
    if kept.get("torn_bytes"):
        line += f"; a torn record of {kept['torn_bytes']} bytes cut from the journal"
    return line
