"""What a resumed run keeps of the rows read back from disk: by whole groups, each drop with its reason, the
chunks of responses in progress up to the first from a discarded version, the kept rows announced."""

import json

import torch

from meshy.dataplane import DataPlaneClient, DataPlaneServer
from meshy.dataplane import columns as cols
from meshy.recipes.launch.servers import resume_rows
from meshy.recipes.recipe import load_recipe
from meshy.recipes.recipe.dataflow import PARTIALS, rollout_table, tables
from meshy.recipes.roles.context import KEPT_ROWS_STREAM
from tests.recipes.test_pipeline import GROUP, GROUPS, small_recipe

VERSION = 5  # the checkpoint resumed from


def put_group(client: DataPlaneClient, group: int, versions: list[list[int]] | None) -> list[int]:
    """A group's prompts, with responses generated under `versions` (one list per row), or none yet."""
    rows = list(range(group * GROUP, (group + 1) * GROUP))
    prompts = {cols.PROMPT_IDS: [torch.tensor([1, 2])] * GROUP, cols.GROUND_TRUTH: ["3"] * GROUP}
    client.put("rollout", rows, prompts, group_ids=[group] * GROUP)
    if versions is not None:
        generated = {
            cols.RESPONSE_IDS: [torch.ones(len(v), dtype=torch.int64) for v in versions],
            cols.ROLLOUT_LOGPROBS: [torch.zeros(len(v)) for v in versions],
            cols.TOKEN_VERSIONS: [torch.tensor(v) for v in versions],
            cols.FINISH_REASON: ["stop"] * GROUP,
            cols.TRUNCATED: torch.zeros(GROUP, dtype=torch.bool),
            cols.ERROR: [""] * GROUP,
        }
        client.add_columns("rollout", rows, generated)
    return rows


def generated_ids() -> list[int]:
    """Rows a line after the restored version trained: the resume discards that line."""
    return list(range(10_000, 10_000 + GROUP))


def put_chunk(client: DataPlaneClient, row: int, chunk: int, versions: list[int]) -> None:
    client.put(
        PARTIALS,
        [cols.partial_row_id(row, chunk)],
        {
            cols.PARTIAL_OF: torch.tensor([row]),
            cols.RESPONSE_IDS: [torch.ones(len(versions), dtype=torch.int64)],
            cols.ROLLOUT_LOGPROBS: [torch.zeros(len(versions))],
            cols.TOKEN_VERSIONS: [torch.tensor(versions)],
        },
    )


def test_a_resume_keeps_the_groups_the_restored_version_may_use_and_drops_the_rest_saying_why(tmp_path, secret):
    recipe_path = small_recipe(tmp_path, "2", top="")
    recipe_path.write_text(recipe_path.read_text().replace("[sampling]\n", "[sampling]\nkeep_partial_every = 2\n"))
    recipe = load_recipe(recipe_path)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / f"step-{VERSION:08d}").mkdir(parents=True)
    per_batch = GROUPS
    with DataPlaneServer.start(secret) as server, DataPlaneClient(server.endpoints, secret) as client:
        for spec in tables(recipe):
            client.create_table(spec)
        before = put_group(client, 4 * per_batch - 1, [[3, 3]] * GROUP)  # batch 3: trained into v4 already
        untrained = put_group(client, 4 * per_batch - 2, [[3, 3]] * GROUP)  # batch 3, never trained: kept
        trained_ahead = list(range(6 * per_batch * GROUP + GROUP, 6 * per_batch * GROUP + 2 * GROUP))  # retired
        # batch 5, under v4 and v5: kept, and trained into v6 by the stopped run (acked only once checkpointed)
        generated = put_group(client, 5 * per_batch, [[4, 5]] * GROUP)
        trained = {"row_ids": [*range(GROUP), *before], "dropped": [{"row": r} for r in trained_ahead]}
        lines = [{"version": 4, **trained}, {"version": 6, "row_ids": [*generated_ids(), *generated], "dropped": []}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
        later = put_group(client, 5 * per_batch + 1, [[5]] * (GROUP - 1) + [[5, 6]])  # one token from v6
        waiting = put_group(client, 5 * per_batch + 2, None)  # prompts only: kept
        next_batch = put_group(client, 6 * per_batch, None)  # W = 2: batch 6 is written at v5
        ahead = put_group(client, 7 * per_batch, None)  # batch 7 is not, until v6
        put_chunk(client, waiting[0], 0, [5, 5])
        put_chunk(client, waiting[0], 1, [6, 6])  # from a version the resumed run discards
        put_chunk(client, waiting[1], 0, [4])
        put_chunk(client, later[0], 0, [5])  # of a row dropped since
        restored = {"controller": {"rows": {"rollout": 28, PARTIALS: 4}, "torn_bytes": 0}, "storage": [None]}
        kept = resume_rows(recipe, run_dir, server.endpoints, secret, restored)

        assert kept["version"] == VERSION
        assert kept["kept"]["rows"] == 2 * GROUP and kept["kept"]["tokens"] == 4 * GROUP
        assert (kept["retrained"]["rows"], kept["retrained"]["tokens"]) == (GROUP, 2 * GROUP)
        assert kept["waiting"]["rows"] == 2 * GROUP
        assert (kept["partial"]["rows"], kept["partial"]["tokens"]) == (2, 3)
        dropped = {reason: (f["rows"], f["tokens"]) for reason, f in kept["dropped"].items()}
        assert dropped == {
            "trained into v5 or before, the version resumed from": (GROUP, 2 * GROUP),
            "generated under a version after v5, which the resumed run discards": (GROUP, GROUP + 1),
            "written ahead of what pacing allows at v5: written again when due": (GROUP, 0),
            "a response in progress: tokens generated under a version after v5": (1, 2),
            "a response in progress of a row no longer waiting for one": (1, 1),
        }
        left = client.peek(rollout_table(recipe).name, [])
        assert sorted(left.row_ids) == sorted(untrained + generated + waiting + next_batch)
        assert not set(left.row_ids) & set(before + later + ahead)
        chunks = client.peek(PARTIALS, [])
        assert sorted(chunks.row_ids) == [cols.partial_row_id(waiting[0], 0), cols.partial_row_id(waiting[1], 0)]
        (announced,) = client.reader(KEPT_ROWS_STREAM, "check", start=1).read(max_n=5)
        # the rows the rollout role writes again from batch 5 on, but these: kept, or trained already
        assert announced.payload["version"] == 5
        assert announced.payload["rows"] == sorted(generated + waiting + next_batch + trained_ahead)
