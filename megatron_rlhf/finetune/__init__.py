"""The stages around RLHF: SFT, reward-model training (Bradley-Terry) and DPO."""
