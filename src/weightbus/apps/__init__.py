"""The apps: the `weightbus` command (`cli.py`), `bench/`, `demo/`, the capacity planner
(`capacity/`, `weightbus plan`), Ray fleets (`ray/`), `weightbus push` (`push.py`) and the engine
launcher they share (`launch.py`). Apps import what they like, but not each other in circles."""
