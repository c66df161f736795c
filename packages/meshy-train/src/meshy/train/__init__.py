"""Meshy train."""

from meshy.dataplane.moved_modules import keep_old_paths

keep_old_paths(
    {
        "meshy.train.config": "meshy.train.training_config",
        "meshy.train.critic": "meshy.train.critic_service",
    },
    removed_in="0.3",
)
