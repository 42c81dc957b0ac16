"""The fleet view reads back exactly the names and units the exporter writes, in every naming."""

from __future__ import annotations

import pytest

from smiquery.fleet import FLEET_FIELDS, NAMINGS
from smiquery.fleet.naming import EXTRA_FIELDS


@pytest.mark.parametrize("naming", [n.name for n in NAMINGS])
def test_metric_names_and_units_match_the_exporter(naming):
    pytest.importorskip("prometheus_client")
    from smiquery.exporter.naming import metric_specs
    from smiquery.fields import resolve_fields

    ours = next(n for n in NAMINGS if n.name == naming)
    for fld in (*FLEET_FIELDS, *EXTRA_FIELDS):
        specs = metric_specs(resolve_fields([fld]), naming)  # type: ignore[arg-type]
        # the names of the samples as scraped (a counter's with _total); the exporter multiplies nvidia-smi's
        # value by its scale, the fleet view divides it back
        assert (ours.metric(fld), ours.factor(fld) * specs[0].scale) == (specs[0].sample, pytest.approx(1.0)), fld
