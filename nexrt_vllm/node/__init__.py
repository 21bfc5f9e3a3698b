"""NexRT decode node (`nexrt-decode`): receive the hand-off, convert, decode, stream."""
