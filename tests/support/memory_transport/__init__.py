"""A transport kept outside ingest/adapters/ for the contract suite: a queue
broker in this process's memory, registered at run time
(``ingest.config.transports.add``) the way an application would add its
own. It runs the same contract every real broker runs
(tests/integration/adapters/test_contract_memory.py); it is no proof of any
real broker's behaviour."""
