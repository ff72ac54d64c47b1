"""The suite's profiles: how many examples each check draws, read by the suite, the command line and the plugin."""

PROFILES = {"fast": 1, "thorough": 10}  # each check's examples in the fast profile, times this
