"""Imports every property module, so the registry is complete once this module is loaded."""

from . import (
    json_suite,  # noqa: F401
    random_properties,  # noqa: F401
    row_properties,  # noqa: F401
    toy_properties,  # noqa: F401
)
