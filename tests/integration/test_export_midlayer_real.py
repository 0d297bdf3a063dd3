"""The midlayer export's round trip at the real AQ-MedAI shape (a 2.4 GB drafter written and read back)."""

import pytest

from ..unit.export.test_export_midlayer import round_trip

pytestmark = pytest.mark.integration  # a 2.4 GB checkpoint written and read back: ~30 s


def test_the_midlayer_export_round_trips_at_the_real_shape(tmp_path):
    round_trip("real", tmp_path)
