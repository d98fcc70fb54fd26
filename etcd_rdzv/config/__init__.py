"""Configuration: every option declared once, parsed once, at the edge.

* :mod:`._options`: the option table (name, type, default, bounds, reader: which
  settings object holds it, environment variable, CLI flag, help) and the
  unknown-option check;
* :mod:`._values`: how options read simple values and texts that have a form;
* :mod:`._endpoints`: the ``endpoint`` option, parsed into validated endpoints;
* :mod:`._node`: what identifies this node in a job (its static rank, ``node_group``,
  ``node_unit``, ``host_id``) and the address it publishes;
* :mod:`.params`: ``RendezvousParameters`` and ``Settings`` (frozen, validated objects
  that read their options from the table);
* :mod:`.docs`: the option tables of the docs, generated from the table.

Imports nothing of the package but :mod:`etcd_rdzv.errors` and :mod:`etcd_rdzv._keys`;
every other part may import it.
"""

from .params import (
    ClientConfig,
    HandlerSettings,
    ParamsLike,
    RendezvousParameters,
    Settings,
)

__all__ = ["ClientConfig", "HandlerSettings", "ParamsLike", "RendezvousParameters", "Settings"]
