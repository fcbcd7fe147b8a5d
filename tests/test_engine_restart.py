"""A restarted engine starts warm: the EAMC saved at shutdown is loaded at start, and the
first requests after the restart hit the expert cache more than after a cold start."""

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import build_checkpoint

PROMPTS = ["Hello there, how are you today?", "The capital of France is", "def fibonacci(n):", "Once upon a time"]


def serve(engine: Engine, prompts: list[str]) -> int:
    """Run the prompts; return the cache hits they made."""
    before = engine.cache_counters()["hits"]
    for i, text in enumerate(prompts):
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        list(engine.generate(GenerationRequest(f"r{i}", engine.encode(text), params)))
    return engine.cache_counters()["hits"] - before


def load(folder, eamc_path) -> Engine:
    # prefetch off: on CPU it runs on a thread whose timing changes the hit count from run to run,
    # while the policy's use of the EAMC is deterministic
    config = EngineConfig(
        model=str(folder), device="cpu", policy="sparsity-aware", expert_cache_experts=12, eamc_path=str(eamc_path),
        prefetch=False,
    )
    return Engine.load(config)


def test_restart_loads_the_saved_eamc_and_starts_warmer_than_a_cold_start(tmp_path):
    folder = build_checkpoint("mixtral", tmp_path / "model", num_layers=4)
    first = load(folder, tmp_path / "warm.eamc")
    serve(first, PROMPTS * 2)
    first.close()  # a graceful shutdown saves the EAMC
    assert (tmp_path / "warm.eamc").is_file()

    restarted = load(folder, tmp_path / "warm.eamc")
    assert restarted.cache_counters()["eamc_entries"] == 2 * len(PROMPTS)
    cold = load(folder, tmp_path / "cold.eamc")
    assert cold.cache_counters()["eamc_entries"] == 0
    assert serve(restarted, PROMPTS) > serve(cold, PROMPTS)


def test_a_corrupt_eamc_file_is_moved_aside_and_the_engine_starts(tmp_path):
    folder = build_checkpoint("mixtral", tmp_path / "model", num_layers=2)
    path = tmp_path / "state.eamc"
    path.write_bytes(b"MOEEAMC\0" + b"\xff" * 100)
    engine = load(folder, path)
    assert engine.cache_counters()["eamc_entries"] == 0
    assert list(tmp_path.glob("state.eamc.corrupt-*"))
    serve(engine, PROMPTS[:1])
    engine.close()
    assert path.is_file()  # a fresh file replaces the corrupt one


def test_a_folder_in_place_of_the_eamc_file_is_a_warning_and_the_engine_serves(tmp_path, caplog):
    folder = build_checkpoint("mixtral", tmp_path / "model", num_layers=2)
    path = tmp_path / "state.eamc"
    path.mkdir()
    engine = load(folder, path)
    assert engine.cache_counters()["eamc_entries"] == 0
    serve(engine, PROMPTS[:1])
    engine.close()  # the save fails with a warning, not an exception
    assert "could not save the EAMC" in caplog.text
