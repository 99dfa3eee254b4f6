"""Which network an epoch trains, as RETURNN's TF engine decides it.

RETURNN trains one fixed ``network`` dict, or a network per epoch: ``pretrain`` (RETURNN's
:class:`returnn.pretrain.Pretrain`, which grows the network over its first epochs) or a
``get_network(epoch=...)`` function in the config. :class:`EpochNetworks` is the one owner of
that decision and of what follows from it as in RETURNN's ``Engine.init_train_epoch``: the
seeds of a new network, how parameters are carried over from the previous network, the
learning rate of pretrain epochs, and the checkpoint name (``model.pretrain.NNN`` for pretrain
epochs).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Set

from returnn_tpu.errors import ConfigError

# ``#config`` entries of a network dict that would need new datasets; RETURNN re-creates them.
_DATASET_KEYS = ("train", "dev", "eval", "eval_datasets", "chunking")


def learning_rate_control(config):
    """RETURNN's learning-rate control of ``config`` (its ``learning_rate_file`` loaded), or a
    ConfigError naming the file when RETURNN cannot read it (bad input, found before training)."""
    from returnn.learning_rate_control import load_learning_rate_control_from_config

    try:
        return load_learning_rate_control_from_config(config)
    except Exception as exc:  # noqa: BLE001 (RETURNN evaluates the file; its errors name no file)
        raise ConfigError(f"learning_rate_file {config.value('learning_rate_file', '')!r} is not a RETURNN "
                          f"learning-rate file ({type(exc).__name__}: {exc}); fix or remove it") from None


class EpochNetworks:
    """The network dict of every epoch, and RETURNN's rules for switching between them."""

    def __init__(self, config):
        from returnn.pretrain import pretrain_from_config

        self.config = config
        self.pretrain = pretrain_from_config(config)
        self.get_network = config.typed_value("get_network", None)
        if self.get_network is not None and not callable(self.get_network):
            raise ConfigError(f"get_network must be a function get_network(epoch, **kwargs), got {self.get_network!r}")
        if self.get_network is None and not isinstance(config.typed_value("network", None), dict):
            raise ConfigError("network must be a dict of layers (or define get_network(epoch))")
        self.initial_learning_rate = config.float("learning_rate", 1.0)
        self.pretrain_learning_rate = config.float("pretrain_learning_rate", self.initial_learning_rate)

    @property
    def changes_per_epoch(self) -> bool:
        return bool(self.pretrain) or self.get_network is not None

    def is_pretrain_epoch(self, epoch: int) -> bool:
        return bool(self.pretrain) and epoch <= self.pretrain.get_train_num_epochs()

    def net_dict(self, epoch: int) -> Dict[str, Any]:
        """The network dict of ``epoch`` (RETURNN's ``Engine.get_net_dict_for_epoch``)."""
        from returnn.config import network_json_from_config

        if self.is_pretrain_epoch(epoch):
            return self.pretrain.get_network_json_for_epoch(epoch)
        if self.get_network is not None:
            net_dict = self.get_network(epoch=epoch)
            if not isinstance(net_dict, dict):
                raise ConfigError(f"get_network(epoch={epoch}) must return a dict of layers, got {type(net_dict).__name__}")
            return net_dict
        if self.pretrain:
            return self.pretrain.get_final_network_json()
        return network_json_from_config(self.config)

    def differs(self, old: Optional[Dict[str, Any]], new: Dict[str, Any]) -> bool:
        """Whether switching from ``old`` to ``new`` needs a new network (RETURNN's own net-dict diff)."""
        from returnn.tf.engine import Engine

        if old is None or self.config.is_true("reinit_network_each_epoch"):
            return True
        return bool(Engine._net_dict_diff(old, new))

    def random_seeds(self, epoch: int):
        """``(network seed, TF global seed)`` of a network created in ``epoch``, as RETURNN derives them."""
        net_seed, tf_seed = epoch, 42
        if self.config.opt_typed_value("random_seed", None):
            seed = self.config.int("random_seed", None)
            net_seed = (epoch * 3 + seed * 5 + 7) % (2**31)
            tf_seed = (net_seed * 2 + 3) % (2**31)
        return net_seed, tf_seed

    def copy_param_mode(self, net_dict: Dict[str, Any], epoch: int) -> Optional[str]:
        """How parameters whose shape changed are carried over: None (re-initialized), ``"subset"``
        (the old values fill the overlapping part), ``"ifpossible"`` or ``"reset"``."""
        default = self.pretrain.copy_param_mode if self.is_pretrain_epoch(epoch) else None
        return net_dict.get("#copy_param_mode", default)

    def reset_output_layers(self, epoch: int) -> bool:
        """Pretrain without ``copy_output_layer``: output layers start from a fresh initialization."""
        return self.is_pretrain_epoch(epoch) and not self.pretrain.copy_output_layer

    def train_param_args(self, epoch: int) -> Dict[str, Any]:
        """Keyword arguments of ``TFNetwork.declare_train_params`` for ``epoch``."""
        return self.pretrain.get_train_param_args_for_epoch(epoch) if self.is_pretrain_epoch(epoch) else {}

    def learning_rate(self, epoch: int, control) -> float:
        """RETURNN's learning rate of ``epoch``: constant ``pretrain_learning_rate`` in pretrain
        epochs, the initial one right after, else from learning-rate control."""
        if self.config.is_true("use_learning_rate_control_always"):
            return control.get_learning_rate_for_epoch(epoch)
        if self.is_pretrain_epoch(epoch):
            rate = self.pretrain_learning_rate
        elif self.pretrain and epoch == self.pretrain.get_train_num_epochs() + 1:
            rate = self.initial_learning_rate
        else:
            return control.get_learning_rate_for_epoch(epoch)
        control.set_default_learning_rate_for_epoch(epoch, rate)
        return rate

    def apply_config_updates(self, net_dict: Dict[str, Any], epoch: int, learning_rate_control) -> Set[str]:
        """Applies a network dict's ``#config`` entries to the config, as RETURNN does; returns the keys.
        A refused option set there stops training as one set in the config does. ``learning_rate``
        is, as in RETURNN's engine, the learning rate of ``epoch`` in the learning-rate control."""
        from returnn.log import log

        from returnn_tpu.startup import check_supported

        updates = net_dict.get("#config", {}) or {}
        for key, value in updates.items():
            if key in _DATASET_KEYS:
                raise ConfigError(
                    f"network '#config' sets {key!r}; changing datasets between epochs is not supported by returnn-tpu"
                )
            if key == "learning_rate":
                old = learning_rate_control.get_learning_rate_for_epoch(epoch)
                print(f"Overwrite learning rate for epoch {epoch}: {old!r} -> {value!r}", file=log.v3)  # RETURNN's line
                learning_rate_control.epoch_data[epoch].learning_rate = value
                continue
            self.config.typed_dict[key] = value
        check_supported(self.config)
        return set(updates)

    def model_filename(self, model: str, epoch: int) -> str:
        """The checkpoint prefix of ``epoch`` (``model.pretrain.NNN`` in pretrain epochs; epoch 0,
        the initial model, is named as epoch 1 is)."""
        from returnn.engine.base import EngineBase

        return EngineBase.epoch_model_filename(model, epoch, is_pretrain=self.is_pretrain_epoch(max(epoch, 1)))

