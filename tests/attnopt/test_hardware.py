"""Hardware profiles: built-ins, JSON round trips, detection by name, the calibrated-profile cache and its
error paths."""
import json
import warnings

import pytest

from attnopt import hardware as H
from attnopt.hardware import BUILTIN_PROFILES, HardwareProfile


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(H.CACHE_ENV, str(tmp_path))
    return tmp_path / "profiles"


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_builtins_round_trip_and_are_uncalibrated(name):
    hw = BUILTIN_PROFILES[name]
    again = HardwareProfile.from_json(hw.to_json())
    assert again == hw
    assert not hw.calibrated and hw.name == name
    assert hw.slots(4) == hw.sm_count * hw.programs_per_sm(4) > 0
    assert hw.sm_gbps() > 0


def test_required_datasheet_profiles_exist():
    assert {"h100-sxm", "h200", "a100-80gb", "rtx-4090", "mi300x", "cpu"} <= set(BUILTIN_PROFILES)
    assert BUILTIN_PROFILES["h200"].hbm_read_gbps > BUILTIN_PROFILES["h100-sxm"].hbm_read_gbps


def test_unknown_profile_lists_valid_names():
    with pytest.raises(ValueError) as err:
        H.resolve_profile("h900")
    for name in ("h100-sxm", "h200", "a100-80gb", "rtx-4090", "mi300x", "cpu"):
        assert name in str(err.value)


def test_unknown_field_and_bad_values_are_errors():
    data = BUILTIN_PROFILES["h100-sxm"].to_dict()
    with pytest.raises(ValueError, match="unknown hardware profile field"):
        HardwareProfile.from_dict({**data, "warp_speed": 9})
    with pytest.raises(ValueError, match="hbm_read_gbps must be > 0"):
        HardwareProfile.from_dict({**data, "hbm_read_gbps": 0})
    with pytest.raises(ValueError, match="version"):
        HardwareProfile.from_dict({**data, "version": 99})


@pytest.mark.parametrize("device,expected", [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H200", "h200"),
                                             ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                                             ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("AMD Instinct MI300X", "mi300x")])
def test_detection_by_device_name(device, expected):
    hw = H.profile_for_device_name(device, sm_count=100, memory_bytes=123)
    assert hw.name == expected and hw.sm_count == 100 and hw.memory_bytes == 123 and hw.device_name == device


def test_unknown_gpu_gets_generic_guesses():
    hw = H.profile_for_device_name("Fancy GPU 9000", sm_count=64)
    assert hw.sm_count == 64 and "calibrate" in hw.source and not hw.calibrated


def test_no_gpu_resolves_to_cpu(monkeypatch):
    monkeypatch.setattr(H, "local_device_name", lambda: None)
    monkeypatch.setattr(H, "detect_profile", lambda: BUILTIN_PROFILES["cpu"])
    assert H.resolve_profile(None).name == "cpu"
    assert H.resolve_profile("local").name == "cpu"


def test_cache_path_uses_the_cache_dir(cache_dir):
    path = H.cached_profile_path("NVIDIA H100 80GB HBM3")
    assert path.parent == cache_dir and path.name == "NVIDIA-H100-80GB-HBM3.json"


def test_calibrated_profile_is_used_for_the_local_device(cache_dir, monkeypatch):
    device = "NVIDIA H100 80GB HBM3"
    cal = H.profile_for_device_name(device).replace(calibrated=True, kernel_efficiency=0.61, source="test fit")
    path = H.save_profile(cal, device)
    assert path.exists() and json.loads(path.read_text())["calibrated"] is True
    monkeypatch.setattr(H, "local_device_name", lambda: device)
    hw = H.resolve_profile(None)
    assert hw == cal and hw.describe() == "h100-sxm (calibrated)"
    # A datasheet name still gives the datasheet profile.
    assert not H.resolve_profile("h100-sxm").calibrated


def test_corrupt_cache_file_warns_and_is_ignored(cache_dir, monkeypatch):
    device = "NVIDIA H200"
    path = H.cached_profile_path(device)
    path.parent.mkdir(parents=True)
    path.write_text("{ this is not json")
    monkeypatch.setattr(H, "local_device_name", lambda: device)
    monkeypatch.setattr(H, "detect_profile", lambda: H.profile_for_device_name(device))
    with pytest.warns(UserWarning, match="corrupt calibrated hardware profile"):
        hw = H.resolve_profile(None)
    assert hw.name == "h200" and not hw.calibrated
    # A well-formed JSON object with a wrong field is just as corrupt.
    path.write_text(json.dumps({"name": "x", "bogus": 1}))
    with pytest.warns(UserWarning, match=str(path.name)):
        assert H.load_cached_profile(device) is None


def test_profile_json_path(tmp_path):
    good = tmp_path / "p.json"
    good.write_text(BUILTIN_PROFILES["a100-80gb"].replace(calibrated=True).to_json())
    assert H.resolve_profile(str(good)).calibrated
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a valid attnopt hardware profile"):
        H.resolve_profile(str(bad))


def test_missing_cache_is_none(cache_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert H.load_cached_profile("NVIDIA H100 80GB HBM3") is None


def test_profile_fitted_to_an_older_model_is_ignored_with_its_reason(cache_dir, monkeypatch):
    """A cached profile of an older version holds factors fitted to another cost model: the planner ignores it and
    says how to refit (calibrate again, or refit from kept measurements)."""
    device = "NVIDIA H100 80GB HBM3"
    path = H.cached_profile_path(device)
    path.parent.mkdir(parents=True)
    old = json.loads(BUILTIN_PROFILES["h100-sxm"].replace(calibrated=True).to_json())
    old["version"] = H.PROFILE_VERSION - 1
    path.write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="older cost model.*--from-samples"):
        assert H.load_cached_profile(device) is None


@pytest.mark.parametrize("change,problem", [
    ({"occupancy": [1, 2]}, "occupancy must be an object of num_warps -> programs"),
    ({"occupancy": {"4": 1.5}}, "occupancy must be an object"),
    ({"fitted": None}, "fitted must be an object of names -> finite numbers"),
    ({"fitted": {"x": "fast"}}, "fitted must be an object"),
    ({"sm_count": 1.5}, "sm_count must be an int"),
    ({"sm_count": True}, "sm_count must be an int"),
    ({"hbm_read_gbps": float("inf")}, "hbm_read_gbps must be a finite number"),
    ({"launch_us": float("nan")}, "launch_us must be a finite number"),
    ({"calibrated": "yes"}, "calibrated must be a bool"),
    ({"name": 7}, "name must be a str"),
])
def test_cached_profile_of_the_wrong_types_warns_one_line_and_falls_back(cache_dir, monkeypatch, change, problem):
    """A foreign or hand-edited cache file must not break every compile: one warning line naming the file and
    the field, then the datasheet profile."""
    device = "NVIDIA H100 80GB HBM3"
    path = H.cached_profile_path(device)
    path.parent.mkdir(parents=True)
    data = {**H.profile_for_device_name(device).replace(calibrated=True).to_dict(), **change}
    path.write_text(json.dumps(data))  # json writes inf and nan as Infinity and NaN, as a foreign writer might
    monkeypatch.setattr(H, "local_device_name", lambda: device)
    monkeypatch.setattr(H, "detect_profile", lambda: H.profile_for_device_name(device))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hw = H.resolve_profile(None)
    assert hw.name == "h100-sxm" and not hw.calibrated
    [w] = caught
    text = str(w.message)
    assert "\n" not in text and str(path) in text and problem in text and "using the built-in profile" in text


def test_profile_json_types_are_checked_on_construction():
    with pytest.raises(TypeError, match="sm_count must be an int"):
        BUILTIN_PROFILES["h100-sxm"].replace(sm_count=1.5)
    with pytest.raises(TypeError, match="sm_count must be an int, got str '132'"):
        HardwareProfile.from_json(json.dumps({**BUILTIN_PROFILES["h100-sxm"].to_dict(), "sm_count": "132"}))


def test_a_cached_profile_can_be_named(cache_dir):
    device = "NVIDIA H100 80GB HBM3"
    H.save_profile(H.profile_for_device_name(device).replace(calibrated=True, kernel_efficiency=0.7), device)
    assert H.cached_profile_names() == ["NVIDIA-H100-80GB-HBM3"]
    hw = H.resolve_profile("NVIDIA-H100-80GB-HBM3")
    assert hw.calibrated and hw.kernel_efficiency == 0.7
