"""``returnn-tpu CONFIG [++key value ...]``: train a RETURNN config as RETURNN's ``rnn.py`` would.

Exit status: 0 on success, 2 for bad input (one line on stderr naming the option; nothing is
written), 1 for a failure during training.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from returnn_tpu.errors import ConfigError

USAGE = "usage: returnn-tpu CONFIG [++key value ...]"


def load_config(argv: List[str]):
    """The RETURNN config from ``CONFIG [++key value ...]``, with RETURNN's override semantics.

    Overrides are applied before the file is loaded (so the config code can read them) and
    again after (so they win), as RETURNN's ``rnn.py`` does.
    """
    from returnn.config import Config, set_global_config

    if not argv or argv[0].startswith(("-", "+")):
        raise ConfigError(USAGE)
    filename, overrides = argv[0], argv[1:]
    if not os.path.isfile(filename):
        raise ConfigError(f"config file {filename!r} does not exist")
    config = Config()
    if overrides:
        config.parse_cmd_args(overrides)
    config.load_file(filename)
    if overrides:
        config.parse_cmd_args(overrides)
    set_global_config(config)
    return config


def distribute_options_from_config(config):
    """The validated ``distribute_strategy`` and ``distribute_options`` of a RETURNN config."""
    from returnn_tpu.options import DistributeOptions

    strategy = config.typed_value("distribute_strategy", None) or config.value("distribute_strategy", "local_sgd")
    options = config.typed_value("distribute_options", None)
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"distribute_options must be a dict, got {options!r}")
    return DistributeOptions.from_config_values(strategy, options)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        from returnn_tpu.returnn_bridge import setup_returnn

        setup_returnn()
        config = load_config(argv)
        options = distribute_options_from_config(config)
        from returnn_tpu.optimizers import optimizer_from_config
        from returnn_tpu.trainer import Trainer, check_supported

        check_supported(config)
        optimizer_from_config(config)  # validates the optimizer options before anything is written
        from returnn.log import log
        from returnn_tpu.session_options import apply_session_options

        ignored = apply_session_options(config)
        for path in [config.value("model", "")] + config.list("log", []):
            if path and path not in ("stdout", "|"):
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        log.init_by_config(config)
        for message in ignored:
            print(f"returnn-tpu: ignoring {message}", file=log.v3)
        Trainer(config, options).train()
    except ConfigError as exc:
        print(f"returnn-tpu: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
