"""The one training loop all train scripts share."""
from zoo.train.config import TrainConfig, add_train_args, config_from_args
from zoo.train.trainer import Task, Trainer, decay_param_groups, main_guard, run, seed_everything, setup_logging

__all__ = ["TrainConfig", "add_train_args", "config_from_args", "Task", "Trainer", "run", "main_guard",
           "seed_everything", "decay_param_groups", "setup_logging"]
