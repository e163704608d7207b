"""What every stage of the detector shares, importing nothing of it: the candidate finding and its evidence
(``candidate``), the table of finding kinds (``kinds``), incident ids (``identity``), one-entry memos (``memo``)
and numpy helpers for small arrays (``numeric``). A type two stages exchange goes here; a stage's own logic does not."""
