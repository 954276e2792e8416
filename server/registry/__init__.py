"""What the server remembers about jobs: the job registry, its journal, quarantined samples."""
