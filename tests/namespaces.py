"""Tests that build namespaces and nftables rules run where both can be made
here (root), and skip elsewhere."""

from __future__ import annotations

import pytest

from gradfabric.net import netns

needs_nft_namespaces = pytest.mark.skipif(
    not netns.usable() or not netns.nft_available(),
    reason="needs root, network namespaces and nftables",
)
