"""A PyTorch Qwen3ForCausalLM written from Hugging Face's modeling_qwen3 (the
transformers release that runs on Debian's torch predates Qwen3): per-head
RMSNorm on q and k before the rotary embedding, grouped-query attention,
SwiGLU MLP, optional tied embeddings."""
import torch


def rms_norm(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Qwen3Reference(torch.nn.Module):
    def __init__(self, cfg, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.V, self.D = cfg["vocab_size"], cfg["hidden_size"]
        self.F, self.L = cfg["intermediate_size"], cfg["num_hidden_layers"]
        self.H, self.KVH = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim", self.D // self.H)
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.theta = cfg.get("rope_theta", 1000000.0)
        self.tied = cfg.get("tie_word_embeddings", False)
        std = cfg.get("initializer_range", 0.02)

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * std)

        def norm(n):
            return torch.nn.Parameter(1.0 + 0.2 * torch.randn(n, generator=g))

        self.embed = w(self.V, self.D)
        self.layers = []
        for i in range(self.L):
            layer = {
                "input_layernorm.weight": norm(self.D),
                "self_attn.q_proj.weight": w(self.H * self.hd, self.D),
                "self_attn.k_proj.weight": w(self.KVH * self.hd, self.D),
                "self_attn.v_proj.weight": w(self.KVH * self.hd, self.D),
                "self_attn.o_proj.weight": w(self.D, self.H * self.hd),
                "self_attn.q_norm.weight": norm(self.hd),
                "self_attn.k_norm.weight": norm(self.hd),
                "post_attention_layernorm.weight": norm(self.D),
                "mlp.gate_proj.weight": w(self.F, self.D),
                "mlp.up_proj.weight": w(self.F, self.D),
                "mlp.down_proj.weight": w(self.D, self.F),
            }
            self.layers.append(layer)
        self.norm = norm(self.D)
        self.lm_head = self.embed if self.tied else w(self.V, self.D)

    def state_dict_hf(self):
        sd = {"model.embed_tokens.weight": self.embed.data, "model.norm.weight": self.norm.data}
        for i, layer in enumerate(self.layers):
            for k, v in layer.items():
                sd[f"model.layers.{i}.{k}"] = v.data
        if not self.tied:
            sd["lm_head.weight"] = self.lm_head.data
        return sd

    def round_to(self, dtype):
        """Rounds every weight to dtype (kept in f32), as a checkpoint of that dtype stores it."""
        with torch.no_grad():
            for t in self.state_dict_hf().values():
                t.copy_(t.to(dtype).float())

    @torch.no_grad()
    def forward(self, ids):
        ids = ids[0]
        T = ids.shape[0]
        x = self.embed[ids]
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.int64).float() / self.hd))
        freqs = torch.outer(torch.arange(T).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((T, T), float("-inf")).triu(1)
        rep = self.H // self.KVH
        for layer in self.layers:
            h = rms_norm(x, layer["input_layernorm.weight"], self.eps)
            q = (h @ layer["self_attn.q_proj.weight"].T).view(T, self.H, self.hd)
            k = (h @ layer["self_attn.k_proj.weight"].T).view(T, self.KVH, self.hd)
            v = (h @ layer["self_attn.v_proj.weight"].T).view(T, self.KVH, self.hd)
            q = rms_norm(q, layer["self_attn.q_norm.weight"], self.eps).transpose(0, 1)
            k = rms_norm(k, layer["self_attn.k_norm.weight"], self.eps).transpose(0, 1)
            v = v.transpose(0, 1)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(rep, dim=0)
            v = v.repeat_interleave(rep, dim=0)
            att = (q @ k.transpose(1, 2)) / (self.hd ** 0.5) + mask
            att = torch.softmax(att.float(), dim=-1)
            o = (att @ v).transpose(0, 1).reshape(T, self.H * self.hd)
            x = x + o @ layer["self_attn.o_proj.weight"].T
            h = rms_norm(x, layer["post_attention_layernorm.weight"], self.eps)
            g = h @ layer["mlp.gate_proj.weight"].T
            u = h @ layer["mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(g) * u) @ layer["mlp.down_proj.weight"].T
        x = rms_norm(x, self.norm, self.eps)
        return (x @ self.lm_head.T).unsqueeze(0)
