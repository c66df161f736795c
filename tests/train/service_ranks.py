"""torchrun body: a 2-rank training service on a data plane the test hosts; 3 versions of 1 group per rank.

With "late-rank-0", rank 0 starts training 2 s after rank 1 (as after a slow restore or publish).
"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from meshy.dataplane import DataPlaneClient, Endpoints, secret_from_env
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.process_group import init_process_group
from meshy.train.publish import DirectoryPublisher
from meshy.train.service import MetricsLog, TrainingService, TrainServiceConfig
from meshy.train.trainer import PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig


def main() -> None:
    out, table, stream = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    late_rank_0 = sys.argv[4:] == ["late-rank-0"]
    init_process_group("cpu")
    rank = dist.get_rank()
    arch = get_model("qwen3-tiny")
    client = DataPlaneClient(
        Endpoints.from_json((out / "endpoints.json").read_text()), secret_from_env(), name=f"rank{rank}"
    )
    model, _ = build_model(arch, ParallelConfig(), device="cpu")
    service = TrainingService(
        client,
        PolicyTrainer(model, OptimConfig(lr=1e-3), LossConfig()),
        DirectoryPublisher(out / "weights", arch, client=client, stream=stream),
        TrainServiceConfig(table=table, groups_per_rank=1, batch_timeout_s=10 if late_rank_0 else 30),
        metrics=MetricsLog(out / "metrics.jsonl"),
    )
    service.publish_initial()
    trained = []
    original_lease = client.lease

    def recording_lease(*args, **kwargs):
        batch = original_lease(*args, **kwargs)
        trained.extend(batch.row_ids if batch is not None else [])
        return batch

    client.lease = recording_lease
    if late_rank_0 and rank == 0:
        time.sleep(2.0)
    for _ in range(3):
        service.train_batch(service.wait_for_batch())
    (out / f"rank{rank}.json").write_text(json.dumps(trained))
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
