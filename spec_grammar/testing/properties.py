"""Imports every property module, so the registry is complete once this module is loaded."""

from . import toy_properties  # noqa: F401
from . import random_properties  # noqa: F401
from . import json_suite  # noqa: F401
