"""The suite's helpers, one package (imported as `tests.support.<module>`): small models
and servers the tests share (`serving_helpers`, `recipe_helpers`, `sglang_fake`), the
fault harness and its worker processes (`fault_*`, `rl_kill_worker`,
`multihost_worker`), ports and child-process environments (`ports`, `child_env`),
fixtures' data (`rl_traces`, `rl_like_segments`, `constrained_case`, `multidevice`,
`html_dom`, `sandbox_tools`) and the suite's profiler (`suite_profile`, with
`suite_profile_site/`, put on PYTHONPATH by scripts/test_profile.sh for child processes).
No test file lives here."""
