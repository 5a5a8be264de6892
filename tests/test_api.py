import importlib

import hybridmem


def test_plan_and_simulate_stay_functions_after_their_modules_are_imported():
    importlib.import_module("hybridmem.graph.plan")
    importlib.import_module("hybridmem.graph.simulate")
    from hybridmem.graph.plan import Plan  # noqa: F401
    assert callable(hybridmem.plan) and hybridmem.plan.__module__ == "hybridmem"
    assert hybridmem.simulate is importlib.import_module("hybridmem.graph.simulate").simulate


def test_public_names_resolve():
    for name in hybridmem.__all__:
        assert getattr(hybridmem, name) is not None, name


def test_unknown_attribute_is_an_attribute_error():
    try:
        hybridmem.no_such_thing
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("expected AttributeError")
