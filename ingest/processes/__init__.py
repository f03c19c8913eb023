"""The long-running processes: the ingester (poll loops), the acker, the dramatiq workers."""
