"""Drafters that are not MTP heads, loaded from their published layouts: DFlash block drafters
(`dflash`), with their layout facts (`layouts`). Each drafter's forward is a pure function of
(the trunk's layer taps, the token block, the drafter's own cache) so a proposer can wrap it; none
drafts in the decode cycle yet (the batch-first drafter contract lands first)."""
