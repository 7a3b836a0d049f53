"""Settings from IBEX_CONTEXT_* environment variables, validated once at start-up.

A setting is one declaration: the variable is declared on the config field it
sets, beside its default (`ibex.envvar.env`), on a layer's config struct or,
for the process's own settings, on `Settings`. Each layer's struct lives in a
module of its own (`ibex.service.admission_config`,
`ibex.sources.retrieval_config`, ...) that loads no I/O library and no numpy,
and neither does importing this package. The modules, by job:

- `values`: a raw value to a typed one (durations with units, bounded numbers,
  URLs, addresses, digests), `redact_url`;
- `settings`: `Settings`, holding each layer's config struct and declaring
  the process's own settings;
- `table`: the table of variables walked from those declarations, and
  `load_settings`;
- `effective`: the values the daemon runs with, those derived from others
  included (`effective_settings`, what `ibex config` prints);
- `checks`: combinations that cannot work, worker ports;
- `typos`: `IBEX_CONTEXT_*` names nothing reads.

Only the composition root (`ibex.service.root`), the CLI and the worker
supervisor read `Settings` (an import-linter contract); every error names the
variable, and a secret's value is never echoed back.
"""

from ibex.assembly.nonce import DEFAULT_MAX_AGE as NONCE_MAX_AGE_DEFAULT
from ibex.assembly.nonce import MAX_MAX_AGE as NONCE_MAX_AGE_MAX
from ibex.assembly.nonce import MIN_KEY_CHARS as NONCE_KEY_MIN_CHARS
from ibex.assembly.nonce import MIN_MAX_AGE as NONCE_MAX_AGE_MIN
from ibex.assembly.output_format import SECTION_ORDERS
from ibex.config.effective import (
    admission_config,
    connections_config,
    drain_grace,
    effective_settings,
    layer_config,
)
from ibex.config.settings import Settings
from ibex.config.table import (
    DURATIONS,
    LAYERS,
    SECRETS,
    TABLE,
    Row,
    load_settings,
    replace_settings,
)
from ibex.config.typos import EXTRA_KNOWN, known_variables, unknown_variables
from ibex.config.values import MS, WITH_UNIT, format_duration, parse_duration, redact_url
from ibex.envvar import PREFIX
from ibex.errors import ConfigError, ConfigFileError

__all__ = [
    "DURATIONS",
    "EXTRA_KNOWN",
    "LAYERS",
    "MS",
    "NONCE_KEY_MIN_CHARS",
    "NONCE_MAX_AGE_DEFAULT",
    "NONCE_MAX_AGE_MAX",
    "NONCE_MAX_AGE_MIN",
    "PREFIX",
    "SECRETS",
    "SECTION_ORDERS",
    "TABLE",
    "WITH_UNIT",
    "ConfigError",
    "ConfigFileError",
    "Row",
    "Settings",
    "admission_config",
    "connections_config",
    "drain_grace",
    "effective_settings",
    "format_duration",
    "known_variables",
    "layer_config",
    "load_settings",
    "parse_duration",
    "redact_url",
    "replace_settings",
    "unknown_variables",
]
