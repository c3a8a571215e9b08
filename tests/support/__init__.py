"""What the tests share: real components started the way the product starts them (swarms of processes, live
validators, weights servers, hostile peers), factories of real files, and fixtures (tests/conftest.py
registers the shared ones)."""
