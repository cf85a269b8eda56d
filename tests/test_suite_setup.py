"""The test run itself: what the suite's speed and its server tests rely on."""

import pytest


@pytest.mark.xdist_group("suite_setup")
def test_loadgroup_keeps_a_group_on_one_worker(request):
    """Under `--dist loadgroup` (pyproject's addopts) pytest-xdist keeps an xdist_group on one worker by suffixing
    each of its node ids with `@group`. pytest 9.2 silently broke that (pytest-xdist issue 1386): the server test
    files then started their server on both workers. Fails when the suffix is missing again."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run under pytest-xdist's --dist loadgroup (e.g. -n 0): nothing is grouped")
    assert request.node.nodeid.endswith("@suite_setup"), (
        f"{request.node.nodeid}: --dist loadgroup does not group tests with this pytest and pytest-xdist "
        f"(pytest-xdist issue 1386); install pytest < 9.2")
