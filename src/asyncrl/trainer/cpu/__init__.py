"""The trainer's CPU speed paths: C kernels (`asyncrl.kernels`) under the log-prob head,
RMSNorm, SwiGLU, rotary embedding, trie attention, gradient passes and AdamW, plus
contiguous-operand linears, persistent compute copies and a warm malloc heap."""
